"""Who may do what: every forged action is refused, over real sockets.

A real coordinator on tcp with CURVE keys made by ``keygen`` (a key per role), real
clients (the ``PipelineClient`` library and raw ``RpcClient``s) and a real shard
worker with the scripted engine (tests/helpers/scripted_engine.py, in process).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers.scripted_engine import ScriptedEngine

from rlix_async.control.client import PipelineClient, ResumeRefused
from rlix_async.control.coordinator import Coordinator
from rlix_async.protocol import (
    Envelope,
    ErrorCode,
    Kind,
    RpcError,
    decode_body,
    decode_envelope,
    encode,
    hello,
)
from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.generation import Sampling
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.security import ClientKeys, ServerKeys, keygen
from rlix_async.shards.router import Router
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import CallTimeout, RpcClient, RpcServer, TransportConfig

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)

SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (1,))}
TOPO_B = {"actor_train": ClusterSpec(1, (2,)), "actor_infer": ClusterSpec(1, (3,))}
TCP = "tcp://127.0.0.1:0"
FAKE_REF = CacheRef(
    pipeline="b",
    owner="rank0",
    version=1,
    segment="x",
    generation=0,
    fingerprint="f",
    total_bytes=1,
    host="h",
)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    keygen(d)  # server + client (admin)
    keygen(d, ["driver-a"], role="driver", pipelines=["a"])
    keygen(d, ["driver-b"], role="driver", pipelines=["b"])
    keygen(d, ["shard"], role="shard", pipelines=["*"])
    return d


async def refused_hello(endpoint: str, identity: str, keys: ClientKeys) -> str:
    client = RpcClient(endpoint, identity, keys=keys)
    with pytest.raises(ConnectionError) as info:
        await client.connect(timeout=10)
    await client.close()
    return str(info.value)


async def test_each_key_connects_only_under_the_identities_of_its_role(keys: Path) -> None:
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        ep = co.endpoint
        drv_a = ClientKeys.load(keys, "driver-a")
        shard = ClientKeys.load(keys, "shard")
        assert "may not connect as 'b/driver/0'" in await refused_hello(ep, "b/driver/0", drv_a)
        assert "may not connect as 'a/infer/0'" in await refused_hello(ep, "a/infer/0", drv_a)
        assert "may not connect as 'a/driver/0'" in await refused_hello(ep, "a/driver/0", shard)
        assert "forbidden" in await refused_hello(ep, "anon-1/driver/0", drv_a)  # no ids
        # ...and each is served under its own
        async with RpcClient(ep, "a/driver/0", keys=drv_a) as ok:
            assert isinstance(await ok.call(m.StatusRequest()), m.StatusReply)
        async with RpcClient(ep, "a/infer/0", keys=shard):
            pass


async def test_a_driver_acts_only_for_its_own_pipeline(keys: Path) -> None:
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        ep = co.endpoint
        b = await PipelineClient.connect(
            ep, pipeline_id="b", keys=ClientKeys.load(keys, "driver-b")
        )
        await b.register(TOPO_B)
        await b.admit()
        assert await b.request("actor_train", "ACTOR_TRAINING", timeout=5) == [2]
        async with RpcClient(ep, "a/driver/0", keys=ClientKeys.load(keys, "driver-a")) as a:
            infer = m.RequestStage(pipeline_id="b", cluster="actor_infer", priority="GENERATION")
            forged: list[m.Message] = [
                m.ReleaseStage(pipeline_id="b", cluster="actor_train"),
                m.Unregister(pipeline_id="b"),
                infer,
                m.ShrinkAll(pipeline_id="b"),
                m.AdmitPipeline(pipeline_id="b"),
                m.RegisterPipeline(pipeline_id="b", clusters=TOPO_B),
                m.ReleaseAndRequest(pipeline_id="b", release="actor_train", request=infer),
                m.Resume(pipeline_id="b", clusters=TOPO_B, admitted=True, held={}),
                m.PublishWeights(pipeline_id="b", ref=FAKE_REF),
            ]
            for msg in forged:
                with pytest.raises(RpcError) as info:
                    await a.call(msg, timeout=5)
                assert info.value.code == ErrorCode.FORBIDDEN, msg
                assert "a/driver/0 may not act for pipeline 'b'" in info.value.detail
            # notifications get no reply: refused all the same, b's progress unchanged
            await b.report_progress(40, 10, force=True)
            async with asyncio.timeout(5):
                while co.registry.pipelines["b"].remaining() != 30:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            await a.notify(m.ReportProgress(pipeline_id="b", target=99, completed=0))
            await a.notify(m.ClearProgress(pipeline_id="b", stream=None))
            await a.call(m.StatusRequest(), timeout=5)  # served after both (one socket)
            assert co.registry.pipelines["b"].remaining() == 30
            assert "b" not in co.executor.shards.weights
        # b's own driver may not publish a version naming another pipeline: b's shards
        # would pull it (and authenticate its server) as that pipeline's
        theirs = msgspec.structs.replace(FAKE_REF, pipeline="a")
        with pytest.raises(RpcError, match="may not publish weights of pipeline 'a'"):
            await b.publish_weights(theirs)
        assert "b" not in co.executor.shards.weights
        # b's lease is untouched by any of it
        assert co.registry.pipelines["b"].held
        assert co.registry.pipelines["b"].admitted
        # the admin key (the CLI's) may act for any pipeline
        async with RpcClient(ep, "admin-1/cli/0", keys=ClientKeys.load(keys)) as admin:
            await admin.call(m.Unregister(pipeline_id="b"), timeout=5)
        assert "b" not in co.registry.pipelines
        await b.close()


async def test_on_ipc_identity_rules_still_hold(ipc_ep: str) -> None:
    """No keys on ipc (every peer is the local user), but a driver still acts only
    for the pipeline its identity names."""
    async with Coordinator(ipc_ep, SHAPE) as co:
        b = await PipelineClient.connect(co.endpoint, pipeline_id="b")
        await b.register(TOPO_B)
        async with RpcClient(co.endpoint, "a/driver/0") as a:
            with pytest.raises(RpcError, match="may not act for pipeline 'b'"):
                await a.call(m.Unregister(pipeline_id="b"), timeout=5)
        assert "b" in co.registry.pipelines
        await b.close()


async def test_a_live_identity_cannot_be_taken_over(keys: Path) -> None:
    """No router handover: a second connection under a live peer's identity (even with
    the same key) is never served, and the live peer keeps its replies."""
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        drv_a = ClientKeys.load(keys, "driver-a")
        async with RpcClient(co.endpoint, "a/driver/0", keys=drv_a) as live:
            usurper = RpcClient(co.endpoint, "a/driver/0", keys=drv_a)
            with pytest.raises(ConnectionError, match="another live process"):
                await usurper.connect(timeout=3)
            await usurper.close()
            assert isinstance(await live.call(m.StatusRequest(), timeout=5), m.StatusReply)
        # once the live one is gone, the identity is free again
        async with RpcClient(co.endpoint, "a/driver/0", keys=drv_a) as back:
            assert isinstance(await back.call(m.StatusRequest(), timeout=5), m.StatusReply)


async def test_a_reply_counts_only_from_the_peer_the_call_went_to(ipc_ep: str) -> None:
    """A peer that guesses a call id cannot answer (or forge a shard's ack for) a call
    sent to another peer: its reply is ignored and the real one still counts."""
    fast = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=30)
    async with RpcServer(ipc_ep, config=fast) as server:
        ctx = zmq.asyncio.Context()
        socks = {}
        for ident in ("p/infer/0", "p/infer/1"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident.encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(server.endpoint)
            await s.send(encode(Kind.REQUEST, 1, hello(ident)))
            assert decode_body(decode_envelope(await s.recv())).type_name == "Welcome"
            socks[ident] = s
        call = asyncio.ensure_future(
            server.call("p/infer/0", m.ShardCommand(action="sleep"), timeout=1.5)
        )
        header = await next_request(socks["p/infer/0"])
        forged = m.ShardAck(state=m.ShardState.ASLEEP)
        await socks["p/infer/1"].send(encode(Kind.REPLY, header.call_id, forged))
        with pytest.raises(CallTimeout):  # the forgery did not answer it
            await call
        call = asyncio.ensure_future(
            server.call("p/infer/0", m.ShardCommand(action="sleep"), timeout=5)
        )
        header = await next_request(socks["p/infer/0"])
        await socks["p/infer/1"].send(encode(Kind.REPLY, header.call_id, forged))
        real = m.ShardAck(state=m.ShardState.ACTIVE)
        await socks["p/infer/0"].send(encode(Kind.REPLY, header.call_id, real))
        assert await call == real
        for s in socks.values():
            s.close()
        ctx.term()


async def next_request(sock: zmq.asyncio.Socket) -> Envelope:
    while True:  # heartbeats come in between
        env = decode_envelope(await sock.recv())
        if env.kind == Kind.REQUEST:
            return env


async def test_a_conflicting_resume_is_refused_whole(ipc_ep: str) -> None:
    """A Resume claiming devices someone else holds changes nothing (not even its
    registration), and the client stops retrying it: its waits fail at once."""
    shared = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (1,))}
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a")
        await a.register(TOPO)
        await a.admit()
        assert await a.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0]
        async with RpcClient(co.endpoint, "c/driver/0") as c:
            claim = m.Resume(
                pipeline_id="c",
                clusters=shared,
                admitted=True,
                held={"actor_infer": "GENERATION", "actor_train": "ACTOR_TRAINING"},
            )
            journal_before = co.status()
            with pytest.raises(RpcError) as info:
                await c.call(claim, timeout=5)
            assert info.value.code == "lease_conflict"
            assert "nothing of this resume was applied" in info.value.detail
        assert "c" not in co.registry.pipelines  # not even registered
        assert co.status().owners == journal_before.owners
        await a.close()


async def test_the_client_gives_up_a_refused_resume(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a")
        await a.register(TOPO)
        await a.admit()
        await a.request("actor_train", "ACTOR_TRAINING", timeout=5)
        # The coordinator forgets a (as if restarted on a lost journal) and another
        # pipeline takes its device; a's reconnection must not loop on its Resume.
        co.registry.remove("a")
        x = await PipelineClient.connect(co.endpoint, pipeline_id="x")
        await x.register({"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (2,))})
        await x.admit()
        await x.request("actor_train", "ACTOR_TRAINING", timeout=5)
        await a._resume(a.rpc)  # what every reconnection runs
        assert a.failed is not None and "refused our resume" in a.failed
        # nothing is sent again: every call fails at once with the refusal
        with pytest.raises(ResumeRefused, match="refused our resume"):
            await asyncio.wait_for(a.request("actor_infer", "GENERATION", timeout=30), 5)
        assert "a" not in co.registry.pipelines
        await a.close()
        await x.close()


async def test_the_client_gives_up_a_resume_into_a_base_group_that_cannot_be(
    ipc_ep: str,
) -> None:
    """A LoRA member resuming into base group g after the coordinator forgot it and a
    pipeline named g registered: refused as bad_group, for good (no retry loop)."""
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a")
        await a.register(TOPO, group="g")
        co.registry.remove("a")  # its group goes with its last member
        g = await PipelineClient.connect(co.endpoint, pipeline_id="g")
        await g.register(TOPO)
        await a._resume(a.rpc)
        assert a.failed is not None and "is the id of a pipeline" in a.failed
        with pytest.raises(ResumeRefused, match="refused our resume"):
            await asyncio.wait_for(a.admit(), 5)
        await a.close()
        await g.close()


async def test_the_client_gives_up_a_resume_whose_topology_the_coordinator_knows_otherwise(
    ipc_ep: str,
) -> None:
    """The coordinator's journal has pipeline a with another topology (the job was
    restarted with a changed config while the coordinator lived on): a's Resume is
    refused as already_registered, for good, and the journal's registration stays."""
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a")
        await a.register(TOPO)
        co.registry.remove("a")
        co.registry.register("a", dict(TOPO_B), 1.0, None)  # what the journal replayed
        await a._resume(a.rpc)
        assert a.failed is not None and "another topology" in a.failed
        with pytest.raises(ResumeRefused, match="refused our resume"):
            await asyncio.wait_for(a.admit(), 5)
        assert co.registry.pipelines["a"].clusters == TOPO_B
        await a.close()


async def test_the_shard_data_plane_serves_with_its_own_key(keys: Path) -> None:
    """Only the coordinator holds the server secret: a shard's tcp data plane serves
    with the shard's key, the router learns that public key from the coordinator,
    and only the pipeline's own routers are served there."""
    shard_server = ServerKeys.load(keys, "shard")
    assert shard_server.public != ServerKeys.load(keys).public
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        drv_a = ClientKeys.load(keys, "driver-a")
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a", keys=drv_a)
        await a.register(TOPO)
        await a.admit()
        worker = await ShardWorker(
            ScriptedEngine(),
            co.endpoint,
            "a",
            0,
            keys=ClientKeys.load(keys, "shard"),
            data_endpoint=TCP,
            data_keys=shard_server,
            sleep_level=1,
        ).start()
        await a.report_progress(10, 0, force=True)
        assert await a.request("actor_infer", "GENERATION", timeout=10) == [0]
        async with asyncio.timeout(5):
            while 0 not in a.data_keys:
                await a.wait_ranks_change(timeout=5)
        assert a.data_keys[0] == shard_server.public.decode()
        router = Router(a, keys=drv_a)
        traj = await router.generate([1, 2, 3], Sampling(max_tokens=3))
        assert len(traj.token_ids) == 3
        await router.close()
        # b's driver key may not reach a's shard, even knowing its endpoint and key
        drv_b = ClientKeys.load(keys, "driver-b").for_server(shard_server.public)
        intruder = RpcClient(worker.data.endpoint, "b/router/0", keys=drv_b)
        with pytest.raises(ConnectionError, match="may not use shard a/infer/0"):
            await intruder.connect(timeout=5)
        await intruder.close()
        await worker.close()
        await a.close()


def test_role_files_are_parsed_strictly(keys: Path) -> None:
    from rlix_async.security import SecurityError

    (keys / "authorized" / "shard.role").write_text("shard\n")  # pipelines missing
    with pytest.raises(SecurityError, match="needs its pipelines"):
        ServerKeys.load(keys)
    (keys / "authorized" / "shard.role").unlink()
    with pytest.raises(SecurityError, match=r"has no shard\.role"):
        ServerKeys.load(keys)


async def test_one_driver_per_pipeline_and_no_status_for_shard_keys(keys: Path) -> None:
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        drv_a = ClientKeys.load(keys, "driver-a")
        assert "may not connect as 'a/driver/1'" in await refused_hello(
            co.endpoint, "a/driver/1", drv_a
        )
        async with RpcClient(co.endpoint, "a/infer/0", keys=ClientKeys.load(keys, "shard")) as s:
            with pytest.raises(RpcError, match="may not read the status"):
                await s.call(m.StatusRequest(), timeout=5)


async def test_a_killed_tcp_peer_comes_back_under_its_identity_at_once(spawn, keys: Path) -> None:
    """kill -9 sends no goodbye: the server still lists the peer when its replacement
    (same identity, same key) says hello, which must be served, not refused."""
    slow = TransportConfig(heartbeat_interval_s=2.0, heartbeat_timeout_s=30.0)
    server = RpcServer(TCP, keys=ServerKeys.load(keys), config=slow)
    async with server:
        first = await asyncio.to_thread(  # (our loop serves its hello meanwhile)
            spawn, "client", server.endpoint, "--keys", str(keys), "--identity", "a/driver/0"
        )
        assert "a/driver/0" in server.peers  # READY: its hello was answered
        first.kill9()
        assert "a/driver/0" in server.peers  # not yet declared dead (30 s timeout)
        async with asyncio.timeout(15):
            back = await RpcClient(
                server.endpoint, "a/driver/0", keys=ClientKeys.load(keys)
            ).connect(timeout=15)
        assert server.peers["a/driver/0"].rejoined
        await back.close()


def _secret(tmp_path: Path) -> tuple[Path, str]:
    """A private file outside the shared-memory directory, and the relative name that
    reaches it from there."""
    import os

    from rlix_async.weights import shm

    secret = tmp_path / "secret.key"
    secret.write_text("not weights")
    secret.chmod(0o600)
    return secret, os.path.relpath(secret, shm.SHM_DIR)


async def test_names_from_the_wire_never_become_paths(ipc_ep: str, tmp_path: Path) -> None:
    """A published reference's segment and fingerprint become file names on every
    shard: the coordinator refuses any that is not one of the pipeline's own segment
    names, and a shard told to sync one anyway (the command sent straight to it)
    refuses it too, opening nothing (an audit hook watches every open)."""
    import sys
    import uuid

    import torch

    from rlix_async.weights import shm
    from rlix_async.weights.cache import WeightCache

    secret, to_secret = _secret(tmp_path)
    opened: list[str] = []
    sys.addaudithook(lambda event, args: event == "open" and "secret" in str(args[0]) and opened.append(str(args[0])))  # fmt: skip

    # a real version of a's (its layout published): only the slot's name is forged,
    # so a shard that trusted it would map the secret as that slot
    cache = WeightCache("a", f"au{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    cache.build(1, {"w": torch.ones(64, 64)})
    ok = cache.promote(1)
    bad = [
        msgspec.structs.replace(ok, segment=s)
        for s in (to_secret, str(secret), "a/../../b", ok.segment + "/../../x", shm.segment_prefix("b", "o") + "slot0")
    ] + [msgspec.structs.replace(ok, fingerprint="../../x")]  # fmt: skip
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a")
        await a.register(TOPO)
        worker = await ShardWorker(ScriptedEngine(), co.endpoint, "a", 0, sleep_level=1).start()
        for ref in bad:
            with pytest.raises(RpcError, match=r"segment names|not 16 hex") as info:
                await a.publish_weights(ref)
            assert info.value.code == ErrorCode.FORBIDDEN
        assert "a" not in co.executor.shards.weights
        # straight to the shard, past the coordinator's check
        for ref in [bad[0], bad[-1], msgspec.structs.replace(ok, pipeline="b", segment=to_secret)]:
            for action in ("wake", "sync"):
                with pytest.raises(RpcError) as info:
                    await co.server.call("a/infer/0", m.ShardCommand(action=action, weights=ref))
                assert info.value.code == ErrorCode.FORBIDDEN
        assert opened == []
        assert worker.synced_version is None
        await worker.close()
        await a.close()
    cache.close()


async def test_a_driver_key_claims_only_what_its_allowance_grants(keys: Path) -> None:
    """``keygen --role driver --devices 0-1 --max-weight 2 --max-priority ACTOR_TRAINING
    --group g``: a registration naming other devices, a larger weight or another base
    group is refused in one line naming the key and the limit, as is a request more
    important than ACTOR_TRAINING; within the allowance all is served."""
    from rlix_async.security import Allowance, parse_devices

    keygen(d := keys, ["driver-c"], role="driver", pipelines=["c"],
           allowance=Allowance(parse_devices("0-1"), 2.0, "ACTOR_TRAINING", frozenset({"g"})))  # fmt: skip
    assert (d / "authorized" / "driver-c.allow").read_text() == (
        "devices 0-1\nmax_weight 2\nmax_priority ACTOR_TRAINING\ngroups g\n"
    )
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        c = await PipelineClient.connect(
            co.endpoint, pipeline_id="c", keys=ClientKeys.load(keys, "driver-c")
        )
        refusals = {
            "devices 2-3 are outside key 'driver-c' (driver for c)'s allowance (0-1)": dict(clusters=TOPO_B),
            "weight 3 is over key 'driver-c' (driver for c)'s max_weight 2": dict(clusters=TOPO, weight=3.0),
            "may not join or create base group 'h' (its groups: g)": dict(clusters=TOPO, group="h"),
        }  # fmt: skip
        for expected, fields in refusals.items():
            with pytest.raises(RpcError, match=re.escape(expected)) as info:
                await c._call(m.RegisterPipeline(pipeline_id="c", **fields))
            assert info.value.code == ErrorCode.FORBIDDEN
        assert "c" not in co.registry.pipelines or not co.registry.pipelines["c"].registered
        await c.register(TOPO, weight=2.0)
        await c.admit()
        with pytest.raises(RpcError, match=r"priority INITIALIZATION is above .* ACTOR_TRAINING"):
            await c.request("actor_train", "INITIALIZATION", timeout=5)
        assert await c.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0]
        await c.close()


async def test_a_pipeline_holding_training_past_its_keys_max_hold_is_dropped(
    keys: Path,
) -> None:
    """``--max-hold``: a pipeline of that key holding a non-preemptable stage longer is
    dropped (as a silent one is) and the devices go to the pipeline waiting for them; a
    key without the bound holds on, and steps back to back, each shorter than the
    bound, are each timed on their own."""
    from rlix_async.security import Allowance

    keygen(keys, ["driver-c"], role="driver", pipelines=["c"], allowance=Allowance(max_hold_s=0.6))
    assert "max_hold 0.6\n" in (keys / "authorized" / "driver-c.allow").read_text()
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        c = await PipelineClient.connect(
            co.endpoint, pipeline_id="c", keys=ClientKeys.load(keys, "driver-c")
        )
        a = await PipelineClient.connect(
            co.endpoint, pipeline_id="a", keys=ClientKeys.load(keys, "driver-a")
        )
        for client in (c, a):
            await client.register(TOPO)
            await client.admit()
        assert await a.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0]
        await asyncio.sleep(1.5)  # a's key has no max_hold: a holds on
        assert "actor_train" in co.registry.pipelines["a"].held
        await a.release("actor_train")
        for _ in range(5):  # 2 s of short holds, released and granted within a tick
            assert await c.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0]
            await asyncio.sleep(0.4)
            await c.release("actor_train")
        assert "c" in co.registry.pipelines
        assert await c.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0]
        waiting = asyncio.ensure_future(a.request("actor_train", "ACTOR_TRAINING", timeout=10))
        # dropped within its bound and a lease-loop tick (0.5 s), and a is served
        assert await asyncio.wait_for(waiting, 5) == [0]
        assert "c" not in co.registry.pipelines
        await c.close()
        await a.close()


async def test_a_revoked_key_is_dropped_and_cannot_come_back(
    keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keygen --revoke NAME`` on a running coordinator's key directory: within a
    check (2 s; 0.1 here) its live peer is dropped, the pipeline's driver counts as
    lost, and the key cannot connect again; other keys are untouched."""
    from rlix_async.security import revoke
    from rlix_async.transport import server as server_module

    monkeypatch.setattr(server_module, "KEY_CHECK_S", 0.1)
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        drv_a, drv_b = ClientKeys.load(keys, "driver-a"), ClientKeys.load(keys, "driver-b")
        a = await PipelineClient.connect(co.endpoint, pipeline_id="a", keys=drv_a)
        b = await PipelineClient.connect(co.endpoint, pipeline_id="b", keys=drv_b)
        await a.register(TOPO)
        await b.register(TOPO_B)
        assert "a/driver/0" in co.server.peers
        removed = revoke(keys, "driver-a")
        assert keys / "authorized" / "driver-a.key" in removed
        assert not (keys / "driver-a.key_secret").exists()
        async with asyncio.timeout(5):
            while "a/driver/0" in co.server.peers:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert not co.registry.pipelines["a"].connected  # lost, as a silent driver would be
        assert "b/driver/0" in co.server.peers
        again = RpcClient(co.endpoint, "a/driver/0", keys=drv_a)
        with pytest.raises(ConnectionError):
            await again.connect(timeout=3)
        await again.close()
        assert isinstance(await b._call(m.StatusRequest()), m.StatusReply)
        await a.close()
        await b.close()


def test_an_allowance_file_keeps_its_numbers_as_written() -> None:
    from rlix_async.security import Allowance, parse_allowance

    allow = Allowance(max_weight=1234567.0, max_hold_s=0.6)
    assert allow.text() == "max_weight 1234567\nmax_hold 0.6\n"  # not 1.23457e+06
    assert parse_allowance(allow.text()) == allow
