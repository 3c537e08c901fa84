"""The child processes of ``rlix-async bench coordinator`` (rlix_async/bench/coordinator.py).

``python -m rlix_async.bench.cluster_load ROLE SPEC.json [INDEX]``:

- ``coordinator``: the real coordinator (``coordinator_main.serve``, the code
  ``rlix-async coordinator`` runs) with timers around the scheduling step
  (snapshot, plan in the planner thread, check and apply on the loop) and a probe of the event loop's lag; the samples are
  written to ``STATS`` when it is stopped. The timers are wrapped around the
  methods from outside, so the coordinator's code is the shipped one.
- ``peers``: many simulated shard workers in one process. Each is its own DEALER
  socket with the identity ``<pipeline>/infer/<rank>``, says hello with the
  devices of its rank (as ``shards/worker.py`` does), heartbeats at the interval
  the coordinator's Welcome asks for and answers every ShardCommand with a
  ShardAck after ``shard_delay_ms`` (sleep: ASLEEP; wake and sync: ACTIVE at the
  version the command carries). Raw sockets on one shared ZMQ context rather than
  one ``RpcClient`` each: an RpcClient owns a ZMQ context (an I/O thread) and two
  timers, which a thousand per process cannot afford; the bytes on the wire are
  the same (``protocol.encode``).
- ``drivers``: pipeline drivers on the real client library (``PipelineClient``),
  each running the RLix cycle of ``pipeline.py``: progress reported as rollout
  advances (at a speed proportional to its awake ranks), then ACTOR_TRAINING
  requested and held for the training time, released, and new weights published.
  Every control call's round trip (send to reply) is timed in the client.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import zmq

from rlix_async.aio import run, until_signalled
from rlix_async.control.client import PipelineClient
from rlix_async.protocol import (
    Error,
    ErrorCode,
    Heartbeat,
    Kind,
    Message,
    ProtocolError,
    Welcome,
    decode_body,
    decode_envelope,
    encode,
    hello,
)
from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import CacheRef, file_part
from rlix_async.protocols.topology import TRAIN, ClusterName, ClusterSpec

_POLLIN, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.NOBLOCK)
TARGET = 256  # trajectories per step: progress moves in 2% buckets of it
GiB = 1 << 30


def raise_fd_limit() -> None:
    """Thousands of sockets: each DEALER holds an FD or two, the ROUTER one per peer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def load_spec(path: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(Path(path).read_text())
    return spec


def topology(raw: dict[str, Any]) -> dict[ClusterName, ClusterSpec]:
    out: dict[ClusterName, ClusterSpec] = {}
    for name, c in raw.items():
        out[cast(ClusterName, name)] = ClusterSpec(tp=c["tp"], devices=tuple(c["devices"]))
    return out


# --- the coordinator, timed ------------------------------------------------------------------


@dataclass
class _Timings:
    """(start, wall seconds, CPU seconds) per timed section, on the monotonic clock all
    processes share. CPU time is this thread's: on a shared 2-core machine the wall time
    of a plan includes the time other processes held the core."""

    samples: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        rows = self.samples.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                rows.append((t0, time.monotonic() - t0, time.thread_time() - c0))

        return timed


async def _lag_probe(rows: list[tuple[float, float, float]], period: float = 0.01) -> None:
    """How late a 10 ms timer fires, and the loop thread's CPU time meanwhile: the
    longest stretch the loop spends in one callback (a plan, a burst of messages)
    shows here. time.monotonic, not loop.time(): uvloop's clock ticks in ms."""
    while True:
        t0, c0 = time.monotonic(), time.thread_time()
        await asyncio.sleep(period)
        t1 = time.monotonic()
        # a lag with little CPU was spent off the loop thread (blocked in a system
        # call, or waiting for a core), not in a callback
        rows.append((t1, max(0.0, t1 - t0 - period), time.thread_time() - c0))


def _time_gc() -> list[tuple[float, float, float]]:
    """(start, seconds, generation) of every cyclic garbage collection: a full one
    over a heap of millions of objects stops the loop like any long callback."""
    rows: list[tuple[float, float, float]] = []
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.monotonic()
        else:
            rows.append((started[0], time.monotonic() - started[0], info["generation"]))

    gc.callbacks.append(callback)
    return rows


def _keeping_snapshots(
    plan: Callable[..., Any], out: str | None, arg: int = 0
) -> Callable[..., Any]:
    """With ``out``: every 25th snapshot the planner sees is written there as JSON, for
    ``rlix-async plan SNAPSHOT.json`` and profiling the planner on live states."""
    if out is None:
        return plan
    import msgspec

    Path(out).mkdir(parents=True, exist_ok=True)
    calls = [0]

    def keeping(*args: Any) -> Any:  # the snapshot is args[arg] (1: a method's)
        calls[0] += 1
        if calls[0] % 25 == 0:
            snap = msgspec.json.encode(args[arg])
            Path(out, f"snapshot-{calls[0]:05d}.json").write_bytes(snap)
        return plan(*args)

    return keeping


def _time_drains() -> list[tuple[float, float, int]]:
    """(start, seconds, messages) of every turn of the coordinator's socket reader."""
    from rlix_async.transport.server import RpcServer

    rows: list[tuple[float, float, int]] = []
    count = [0]
    drain, receive = RpcServer._drain, RpcServer._receive

    def counted(self: Any, frames: Any) -> None:
        count[0] += 1
        receive(self, frames)

    def timed(self: Any) -> None:
        t0, n0 = time.monotonic(), count[0]
        drain(self)
        if count[0] > n0:
            rows.append((t0, time.monotonic() - t0, count[0] - n0))

    RpcServer._receive = counted  # type: ignore[method-assign]
    RpcServer._drain = timed  # type: ignore[method-assign]
    return rows


def _entered(
    rows: list[tuple[str, float, float]], handler: Callable[..., Any]
) -> Callable[..., Any]:
    """``handler`` (a coordinator method taking a message with ``pipeline_id``) that
    records (pipeline, entered, left) in monotonic time, which every process of the
    bench shares (CLOCK_MONOTONIC is system-wide)."""

    def timed(self: Any, msg: Any, ctx: Any) -> Any:
        t0 = time.monotonic()
        try:
            return handler(self, msg, ctx)
        finally:
            rows.append((msg.pipeline_id, t0, time.monotonic()))

    return timed


def serve_coordinator(spec: dict[str, Any]) -> None:
    from rlix_async.config import CoordinatorConfig, load_config
    from rlix_async.control import coordinator as co
    from rlix_async.control.journal import Journal
    from rlix_async.control.planner_proc import PlannerProcess
    from rlix_async.control.registry import Registry
    from rlix_async.coordinator_main import serve as serve_real_coordinator

    raise_fd_limit()
    logging.basicConfig(  # as `rlix-async coordinator` logs (rlix_async/cli/__init__.py)
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(spec["coordinator_config"], CoordinatorConfig)
    t = _Timings()
    # Class attributes: the scheduler loop takes self.registry.snapshot(), runs the
    # module's plan in the planner thread, then self._carry_out() on the loop (a
    # snapshot again, check_plan, apply): "schedule" is that on-loop part.
    co.Coordinator._carry_out = t.wrap("schedule", co.Coordinator._carry_out)  # type: ignore[method-assign]
    co.plan = t.wrap("plan", _keeping_snapshots(co.plan, spec.get("snapshots")))  # in the thread
    PlannerProcess.plan = t.wrap(  # type: ignore[method-assign]  # the round trip to the process
        "plan", _keeping_snapshots(PlannerProcess.plan, spec.get("snapshots"), arg=1)
    )
    co.check_plan = t.wrap("check", co.check_plan)
    # the drivers' calls as the coordinator sees them: (pipeline, entered, left) per
    # handler, matched with the drivers' own (type, pipeline, start, round trip) to
    # split a round trip into before the handler, the handler, and after it
    handled: dict[str, list[tuple[str, float, float]]] = {}
    for name, attr in (
        ("RequestStage", "_request"),
        ("ReleaseStage", "_release"),
        ("PublishWeights", "_publish_weights"),
    ):
        setattr(
            co.Coordinator,
            attr,
            _entered(handled.setdefault(name, []), getattr(co.Coordinator, attr)),
        )
    Registry.snapshot = t.wrap("snapshot", Registry.snapshot)  # type: ignore[method-assign]
    # every journal append is a write(2) on the loop (an fsync too, for some events)
    Journal.record = t.wrap("journal", Journal.record)  # type: ignore[method-assign]
    # every fsync, also the one a plan's batch of events ends with (outside record)
    Journal.sync = t.wrap("journal_sync", Journal.sync)  # type: ignore[method-assign]
    drains = _time_drains()
    lag: list[tuple[float, float, float]] = []
    gc_pauses = _time_gc()

    async def main() -> None:
        if spec.get("slow_callback_ms"):  # asyncio debug: every slow callback is logged
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = spec["slow_callback_ms"] / 1000
        probe = asyncio.ensure_future(_lag_probe(lag))
        try:
            await serve_real_coordinator(cfg)
        finally:
            probe.cancel()

    try:
        run(main())
    finally:
        Path(spec["coordinator_stats"]).write_text(
            json.dumps(
                {**t.samples, "lag": lag, "gc": gc_pauses, "handled": handled, "drains": drains}
            )
        )


# --- simulated shard workers -----------------------------------------------------------------


@dataclass
class _Shard:
    identity: str
    devices: list[int]
    sock: zmq.Socket[Any]
    hello_id: int = 0
    welcomed: bool = False
    asleep: bool = True
    version: int | None = None
    last_from_server: float = 0.0
    last_beat: float = 0.0


class ShardPeers:
    """Simulated shard workers, one DEALER socket each, on one event loop."""

    def __init__(
        self, endpoint: str, shards: list[tuple[str, list[int]]], delay_s: float, hb_s: float
    ) -> None:
        self.endpoint = endpoint
        self.delay_s = delay_s
        self.hb_s = hb_s  # until a Welcome says otherwise
        self.hb_timeout_s = 2.5 * hb_s
        self.ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, len(shards) + 64)  # default cap: 1023 sockets
        self.shards = [_Shard(ident, devices, self._socket(ident)) for ident, devices in shards]
        self.loop = asyncio.get_running_loop()
        self._ids = 0
        self.closed = False  # acks still timed when we are stopped are not sent
        self._heartbeat = encode(Kind.HEARTBEAT, 0, Heartbeat(instance=f"peers-{os.getpid()}"))
        self.stats: dict[str, Any] = {
            "peers": len(shards),
            "commands": {"sleep": 0, "wake": 0, "sync": 0},
            "not_registered": 0,  # told by the coordinator that it forgot us
            "refused": [],
            "server_gap_max_s": 0.0,  # longest silence of the coordinator seen by a peer
            "server_silent": 0,  # gaps over the heartbeat timeout (a real worker reconnects)
            "hb_gap_max_s": 0.0,  # longest gap between two heartbeats one peer sent
            "dropped_sends": 0,
        }

    def _socket(self, identity: str) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.DEALER)
        for opt, value in (
            (zmq.LINGER, 0),
            (zmq.SNDHWM, 10_000),
            (zmq.RCVHWM, 10_000),
            (zmq.RECONNECT_IVL, 100),
            (zmq.RECONNECT_IVL_MAX, 2000),
        ):
            sock.setsockopt(opt, value)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        return sock

    async def start(self, timeout: float) -> None:
        for s in self.shards:
            s.sock.connect(self.endpoint)
            self.loop.add_reader(s.sock.getsockopt(zmq.FD), self._drain, s)  # type: ignore[arg-type]  # an int
            self._hello(s)
        deadline = time.monotonic() + timeout
        while not all(s.welcomed for s in self.shards):
            if time.monotonic() > deadline:
                missing = sum(not s.welcomed for s in self.shards)
                raise TimeoutError(f"{missing} simulated shards got no Welcome in {timeout}s")
            await asyncio.sleep(0.05)

    def close(self) -> None:
        self.closed = True
        for s in self.shards:
            self.loop.remove_reader(s.sock.getsockopt(zmq.FD))  # type: ignore[arg-type]
            s.sock.close(0)
        self.ctx.term()

    def _hello(self, s: _Shard) -> None:
        self._ids += 1
        s.hello_id = self._ids
        info = {"role": "infer", "devices": s.devices, "data_endpoint": f"tcp://bench:{s.hello_id}"}
        self._send(s, encode(Kind.REQUEST, s.hello_id, hello(s.identity, **info)))

    def _send(self, s: _Shard, frame: bytes) -> None:
        if self.closed:
            return
        try:
            s.sock.send(frame, _NOBLOCK)
        except zmq.Again:
            self.stats["dropped_sends"] += 1
        # a send may consume the FD's edge while a message waits: look again
        if s.sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int
            self.loop.call_soon(self._drain, s)

    def _drain(self, s: _Shard) -> None:
        sock = s.sock
        while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int
            frames = sock.recv_multipart(_NOBLOCK)
            try:
                self._receive(s, frames)
            except ProtocolError as exc:
                self.stats["refused"].append(f"{s.identity}: {exc}")

    def _receive(self, s: _Shard, frames: list[bytes]) -> None:
        now = time.monotonic()
        if s.welcomed:
            gap = now - s.last_from_server
            if gap > self.stats["server_gap_max_s"]:
                self.stats["server_gap_max_s"] = gap
            if gap > self.hb_timeout_s:
                self.stats["server_silent"] += 1
        s.last_from_server = now
        env = decode_envelope(frames[0])
        if env.kind == Kind.HEARTBEAT:
            return
        if env.kind == Kind.REPLY and env.call_id == s.hello_id:
            welcome = decode_body(env)
            if isinstance(welcome, Welcome):  # beat as often as the coordinator expects
                self.hb_s = min(self.hb_s, welcome.heartbeat_interval_s)
                self.hb_timeout_s = welcome.heartbeat_timeout_s
            s.welcomed, s.last_beat = True, now
            return
        if env.kind == Kind.ERROR:
            err = decode_body(env)
            assert isinstance(err, Error)
            if err.code == ErrorCode.NOT_REGISTERED:  # forgotten (declared dead): hello again
                self.stats["not_registered"] += 1
                s.welcomed = False
                self._hello(s)
            elif env.call_id == s.hello_id:
                self.stats["refused"].append(f"{s.identity}: [{err.code}] {err.message}")
            return
        if env.kind == Kind.REQUEST:
            cmd = decode_body(env)
            if isinstance(cmd, m.ShardCommand):
                self.stats["commands"][cmd.action] += 1
                self.loop.call_later(self.delay_s, self._ack, s, env.call_id, cmd)

    def _ack(self, s: _Shard, call_id: int, cmd: m.ShardCommand) -> None:
        """What ShardWorker answers: the state after the command and its weights."""
        if cmd.action == "sleep":
            s.asleep = True
        elif cmd.action == "wake":
            s.asleep = False
        if not s.asleep and cmd.weights is not None:
            s.version = cmd.weights.version
        if s.asleep:
            state = m.ShardState.ASLEEP
        else:
            state = m.ShardState.ACTIVE if s.version is not None else m.ShardState.WAKING
        ack = m.ShardAck(
            state=state, weight_version=s.version, memory_bytes=(2 if s.asleep else 70) * GiB
        )
        self._send(s, encode(Kind.REPLY, call_id, ack))

    async def heartbeat(self) -> None:
        """Each peer beats once per interval, the peers spread evenly over it (as
        independent workers started at different times would be)."""
        n, start, sent = len(self.shards), time.monotonic(), 0
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            due = int((now - start) / self.hb_s * n)
            while sent < due:
                s = self.shards[sent % n]
                sent += 1
                if not s.welcomed:
                    continue
                gap = now - s.last_beat
                if gap > self.stats["hb_gap_max_s"]:
                    self.stats["hb_gap_max_s"] = gap
                s.last_beat = now
                self._send(s, self._heartbeat)


async def run_peers(spec: dict[str, Any], index: int) -> None:
    raise_fd_limit()
    mine = spec["peer_groups"][index]
    peers = ShardPeers(
        spec["endpoint"],
        [(ident, devices) for ident, devices in mine],
        spec["shard_delay_ms"] / 1000,
        spec["heartbeat_interval_s"],
    )
    beating = asyncio.ensure_future(peers.heartbeat())  # from each peer's Welcome on
    await peers.start(timeout=120)
    print("READY", flush=True)
    await until_signalled()
    beating.cancel()
    peers.stats["hb_gap_max_s"] = round(peers.stats["hb_gap_max_s"], 3)
    peers.stats["server_gap_max_s"] = round(peers.stats["server_gap_max_s"], 3)
    peers.stats["refused"] = peers.stats["refused"][:5]
    print(json.dumps(peers.stats), flush=True)
    peers.close()


# --- pipeline drivers --------------------------------------------------------------------------


class TimedClient(PipelineClient):
    """The client library, with every control call's round trip recorded: ``_call`` is
    where each request (RequestStage, ReleaseStage, PublishWeights, ...) goes out and
    its reply comes back; a grant that follows later is not part of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, float, float, str]] = []  # (type, start, seconds, pipeline)

    async def _call(self, msg: Message, *, timeout: float = 120.0) -> Message:
        t0 = time.monotonic()
        try:
            return await super()._call(msg, timeout=timeout)
        finally:
            self.calls.append((msg.type_name, t0, time.monotonic() - t0, self.pipeline_id))


@dataclass
class _DriverStats:
    grants: list[tuple[float, float]] = field(default_factory=list)  # (start, wait s)
    steps: list[float] = field(default_factory=list)  # when each step was published
    progress_sent: int = 0


async def _pipeline(
    pc: TimedClient, spec: dict[str, Any], rng: random.Random, st: _DriverStats
) -> None:
    """The cycle of pipeline.py: collect a batch (progress in 2% buckets, speed
    proportional to the awake ranks), train on the gang, release, publish weights."""
    train_s = spec["step_s"] * spec["train_fraction"]
    rollout_s = spec["step_s"] - train_s
    per_rank = TARGET / (rollout_s * spec["typical_ranks"])  # trajectories/s per awake rank
    # a random point of the cycle, so the cluster starts near its steady state
    done = float(TARGET) if rng.random() < spec["train_fraction"] else rng.uniform(0, TARGET)
    version = 0
    await pc.report_progress(TARGET, int(done), force=True)
    while True:
        last = time.monotonic()
        while done < TARGET:
            await asyncio.sleep(rollout_s / 200)
            now = time.monotonic()
            done = min(float(TARGET), done + per_rank * len(pc.active_ranks) * (now - last))
            last = now
            st.progress_sent += await pc.report_progress(TARGET, int(done))
        t0 = time.monotonic()
        await pc.request(TRAIN, "ACTOR_TRAINING")
        st.grants.append((t0, time.monotonic() - t0))
        await asyncio.sleep(train_s)
        await pc.release(TRAIN)
        version += 1
        await pc.publish_weights(
            CacheRef(
                pipeline=pc.pipeline_id,
                owner=f"{pc.pipeline_id}/driver/0",
                version=version,
                # names of the pipeline's own form (the coordinator checks them): the
                # bench's drivers write no segment, the shards here sync nothing
                segment=f"rlix-{os.getuid()}-{file_part(pc.pipeline_id)}-{0:010}-bench{version % 2}",
                generation=2 * version,
                fingerprint=f"{0:016}",
                total_bytes=16 * GiB,
                host="bench",
            )
        )
        st.steps.append(time.monotonic())
        done = 0.0
        st.progress_sent += await pc.report_progress(TARGET, 0, force=True)


async def run_drivers(spec: dict[str, Any], index: int) -> None:
    raise_fd_limit()
    mine: list[str] = spec["driver_groups"][index]
    clients: list[TimedClient] = []
    for pid in mine:
        pc = await TimedClient.connect(spec["endpoint"], pipeline_id=pid, timeout=120)
        assert isinstance(pc, TimedClient)
        await pc.register(topology(spec["pipelines"][pid]))
        await pc.admit()
        clients.append(pc)
    print("READY", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t_end = float(line.split()[1])  # "GO <t_end>" (monotonic)
    for pc in clients:
        pc.calls.clear()  # registration is not the steady state
    st = _DriverStats()
    lag: list[tuple[float, float, float]] = []  # a late reply may be this loop's, not the
    probe = asyncio.ensure_future(_lag_probe(lag))  # coordinator's: measured to tell
    rng = random.Random(spec["seed"] * 1000 + index)
    loops = [
        asyncio.ensure_future(_pipeline(pc, spec, rng, st))
        for pc in clients
        if not spec["idle"]  # idle: connected and heartbeating, nothing to schedule
    ]
    await asyncio.sleep(max(0.0, t_end - time.monotonic()))
    failed = [repr(t.exception()) for t in loops if t.done() and t.exception() is not None]
    for t in [*loops, probe]:
        t.cancel()
    await asyncio.gather(*loops, probe, return_exceptions=True)
    out = {
        "calls": [c for pc in clients for c in pc.calls],
        "grants": st.grants,
        "steps": st.steps,
        "progress_sent": st.progress_sent,
        "failed": failed[:5],
        "reconnects": sum(pc.rpc.reconnects for pc in clients),
        "lag": lag,
    }
    print(json.dumps(out), flush=True)
    await asyncio.gather(*(pc.close() for pc in clients))


def main(argv: list[str]) -> None:
    role, spec = argv[0], load_spec(argv[1])
    # first, so the planner process (a child of the coordinator) inherits it
    cpus = spec.get("coordinator_cpus" if role == "coordinator" else "load_cpus")
    if cpus:
        os.sched_setaffinity(0, cpus)
    if role == "coordinator":
        serve_coordinator(spec)
    elif role == "peers":
        run(run_peers(spec, int(argv[2])))
    elif role == "drivers":
        run(run_drivers(spec, int(argv[2])))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
