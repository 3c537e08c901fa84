"""``rlix-async bench rpc``: round trip and pipelined throughput between two processes.

The server runs in a child process (spawned, its own event loop); the client in
this one times ``Ping -> Pong`` calls one at a time (p50/p99), then keeps a window
of calls in flight (throughput). For ipc, two floors are timed in the same rounds:
a blocking pyzmq echo and the same echo on our event loop without the protocol.
With ``--vs-ray`` the same call pattern runs against a Ray actor in the same run,
so the comparison shares the machine state.

``--pin`` places the processes: ``none`` leaves it to the kernel, ``shared`` puts
client and server (and the floors, and Ray's processes) on one CPU, ``split`` the
client on one CPU and the server on another. On a VM a wake-up across vCPUs costs
tens of microseconds, which is most of an unpinned round trip (docs/PERF.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from rlix_async.aio import run as aio_run
from rlix_async.protocol import Ping, Pong
from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint, keygen, remove_ipc_file
from rlix_async.transport import RpcClient, RpcServer
from rlix_async.transport.endpoint import zmq_fd

Transport = Literal["ipc", "tcp"]
Pin = Literal["none", "shared", "split"]


@dataclass(frozen=True)
class RpcBenchConfig:
    transport: Transport = "ipc"
    calls: int = 5000
    warmup: int = 500
    window: int = 64
    throughput_s: float = 2.0
    vs_ray: bool = False
    pin: Pin = "none"  # kernel placement, client and server on one CPU, or one CPU each


def _placement(pin: str) -> tuple[set[int] | None, set[int] | None]:
    """(client CPUs, server CPUs) for a ``--pin`` mode; None leaves it to the kernel."""
    if pin == "none":
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if pin == "shared":
        return {cpus[0]}, {cpus[0]}
    if pin == "split":
        if len(cpus) < 2:
            raise ValueError("--pin split needs two CPUs; this process may use one")
        return {cpus[0]}, {cpus[1]}
    raise ValueError(f"unknown --pin {pin!r} (none, shared or split)")


@contextlib.contextmanager
def _running_on(cpus: set[int] | None) -> Iterator[None]:
    """This process on ``cpus`` for the block (processes started in it inherit them)."""
    own = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _pinned(cpus: set[int] | None, target: Any, *args: Any) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    target(*args)


def _percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _serve(endpoint: str, keys_dir: str | None, ready: Any, stop: Any) -> None:
    async def main() -> None:
        keys = ServerKeys.load(keys_dir) if keys_dir else None
        server = RpcServer(endpoint, keys=keys, name="bench-server")
        server.on(Ping, lambda msg, ctx: Pong(seq=msg.seq))
        await server.start()
        ready.put((server.endpoint, sorted(os.sched_getaffinity(0))))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, stop.wait)
        await server.close()

    aio_run(main())


def _measure_ray(cfg: RpcBenchConfig, server_cpus: set[int] | None) -> dict[str, float]:
    import ray

    @ray.remote
    class Echo:
        def __init__(self, cpus: set[int] | None) -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        def ping(self, seq: int) -> int:
            return seq

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actor = Echo.remote(server_cpus)  # type: ignore[attr-defined]
        for i in range(cfg.warmup):
            ray.get(actor.ping.remote(i))
        lat: list[float] = []
        for i in range(cfg.calls):
            t0 = time.perf_counter_ns()
            ray.get(actor.ping.remote(i))
            lat.append((time.perf_counter_ns() - t0) / 1000)
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < cfg.throughput_s:
            ray.get([actor.ping.remote(i) for i in range(cfg.window)])
            done += cfg.window
        elapsed = time.perf_counter() - start
    finally:
        ray.shutdown()
    lat.sort()
    return {
        "ray_p50_us": _percentile(lat, 0.50),
        "ray_p99_us": _percentile(lat, 0.99),
        "ray_throughput_rps": done / elapsed,
    }


def _raw_echo(endpoint: str, ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.put(endpoint)
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close(linger=0)
    ctx.term()
    remove_ipc_file(endpoint)


def _asyncio_echo(endpoint: str, ready: Any) -> None:
    import zmq

    async def main() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def drain() -> None:  # the edge-triggered ZMQ FD, read as the transport reads it
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator,arg-type]  # an int
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if frames[1] == b"stop" and not stopped.done():
                    stopped.set_result(None)
                sock.send_multipart(frames, zmq.NOBLOCK)

        loop.add_reader(zmq_fd(sock), drain)
        ready.put(endpoint)
        drain()
        await stopped
        loop.remove_reader(zmq_fd(sock))
        sock.close(linger=0)
        ctx.term()
        remove_ipc_file(endpoint)

    aio_run(main())


# A Ping-sized msgpack frame for the floors.
_PAYLOAD = b"\x94\x01\x01\xa4Ping\x81\xa3seq\x01"


class _Floors:
    """Clients of the two floors, in this process: a blocking pyzmq echo (no event
    loop, no protocol) and the same echo with our event loop on both ends."""

    def __init__(self, raw_endpoint: str, aio_endpoint: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.raw = self.ctx.socket(zmq.DEALER)
        self.aio = self.ctx.socket(zmq.DEALER)
        for sock, ep in ((self.raw, raw_endpoint), (self.aio, aio_endpoint)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep)
        self.loop = asyncio.get_running_loop()
        self.waiting: list[asyncio.Future[bytes]] = []
        self.loop.add_reader(zmq_fd(self.aio), self._drain)

    def _drain(self) -> None:
        import zmq

        while self.aio.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator,arg-type]  # an int
            frame = self.aio.recv(zmq.NOBLOCK)
            if self.waiting and not self.waiting[0].done():
                self.waiting.pop().set_result(frame)

    def raw_call(self) -> None:
        self.raw.send(_PAYLOAD)
        self.raw.recv()

    async def aio_call(self) -> None:
        import zmq

        fut = self.loop.create_future()
        self.waiting.append(fut)
        self.aio.send(_PAYLOAD, zmq.NOBLOCK)
        self._drain()  # a send may consume the FD's edge
        await asyncio.wait_for(fut, 10)

    def close(self) -> None:

        self.loop.remove_reader(zmq_fd(self.aio))
        for sock in (self.raw, self.aio):
            sock.send(b"stop")
            sock.close()
        self.ctx.term()


async def _measure(
    endpoint: str,
    keys: ClientKeys | None,
    floors: tuple[str, str] | None,
    cfg: RpcBenchConfig,
) -> dict[str, float]:
    """Round trips, interleaved in rounds with the floors so that all share the
    machine's state (this VM's latency drifts by 2x within a minute), then throughput."""
    client = await RpcClient(endpoint, "bench/client/0", keys=keys).connect(timeout=30)
    fl = _Floors(*floors) if floors else None
    lat: dict[str, list[float]] = {"": [], "zmq_floor_": [], "asyncio_floor_": []}
    try:

        async def ours() -> None:
            await client.call(Ping(seq=0))

        async def raw() -> None:
            assert fl is not None
            fl.raw_call()

        kinds = [("", ours)]
        if fl is not None:
            kinds += [("zmq_floor_", raw), ("asyncio_floor_", fl.aio_call)]
        for _, call in kinds:
            for _ in range(cfg.warmup):
                await call()
        rounds = max(1, cfg.calls // 1000)
        for r in range(rounds):
            n = cfg.calls // rounds + (1 if r < cfg.calls % rounds else 0)
            for key, call in kinds:
                for _ in range(n):
                    t0 = time.perf_counter_ns()
                    await call()
                    lat[key].append((time.perf_counter_ns() - t0) / 1000)
        done = 0
        deadline = time.perf_counter() + cfg.throughput_s

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await client.call(Ping(seq=done))
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cfg.window)))
        elapsed = time.perf_counter() - start
    finally:
        if fl is not None:
            fl.close()
        await client.close()
    out = {"mean_us": statistics.fmean(lat[""]), "throughput_rps": done / elapsed}
    for key, values in lat.items():
        if values:
            values.sort()
            out[f"{key}p50_us"] = _percentile(values, 0.50)
            out[f"{key}p99_us"] = _percentile(values, 0.99)
    return out


def run_rpc_bench(cfg: RpcBenchConfig) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rlix-bench-") as tmp:
        keys_dir: str | None = None
        if cfg.transport == "tcp":
            keys_dir = f"{tmp}/keys"
            keygen(keys_dir)
            endpoint = "tcp://127.0.0.1:0"
        elif cfg.transport == "ipc":
            endpoint = ipc_endpoint(f"bench-{time.time_ns()}")
        else:
            raise ValueError(f"unknown transport {cfg.transport!r} (ipc or tcp)")
        client_cpus, server_cpus = _placement(cfg.pin)
        ready, stop = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=_pinned,
                args=(server_cpus, _serve, endpoint, keys_dir, ready, stop),
                daemon=True,
            )
        ]
        floor_ready = []
        if cfg.transport == "ipc":  # the floors are ipc echoes
            stamp = time.time_ns()
            for target, name in ((_raw_echo, "raw"), (_asyncio_echo, "aio")):
                floor_ready.append(q := ctx.Queue())
                ep = ipc_endpoint(f"bench-{name}-{stamp}")
                procs.append(
                    ctx.Process(target=_pinned, args=(server_cpus, target, ep, q), daemon=True)
                )
        for proc in procs:
            proc.start()
        with _running_on(client_cpus), _stopping(procs, stop):
            bound, served_on = ready.get(timeout=60)
            floors = (
                (floor_ready[0].get(timeout=60), floor_ready[1].get(timeout=60))
                if floor_ready
                else None
            )
            keys = ClientKeys.load(keys_dir) if keys_dir else None
            result: dict[str, Any] = {
                "transport": cfg.transport,
                "pin": cfg.pin,
                "client_cpus": sorted(os.sched_getaffinity(0)),
                "server_cpus": served_on,
                "calls": cfg.calls,
                "window": cfg.window,
            }
            result.update(aio_run(_measure(bound, keys, floors, cfg)))
    if cfg.vs_ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            result["ray"] = "not installed (pip install 'rlix_async[bench]')"
        else:
            with _running_on(client_cpus):  # Ray's processes, started there, inherit it
                result.update(_measure_ray(cfg, server_cpus))
            result["ray_speedup_p50"] = result["ray_p50_us"] / result["p50_us"]
    return result


@contextlib.contextmanager
def _stopping(procs: list[Any], stop: Any) -> Iterator[None]:
    """Stop the server processes after the block, killing any that hang."""
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def format_rpc_result(r: dict[str, Any]) -> str:
    lines = [
        f"transport {r['transport']}, pin {r.get('pin', 'none')}: {r['calls']} sequential calls, "
        f"window {r['window']}",
        f"  rlix_async  p50 {r['p50_us']:8.1f} us   p99 {r['p99_us']:8.1f} us   "
        f"throughput {r['throughput_rps']:10.0f} calls/s",
    ]
    if "zmq_floor_p50_us" in r:
        lines.append(
            f"  zmq floor   p50 {r['zmq_floor_p50_us']:8.1f} us   p99 {r['zmq_floor_p99_us']:8.1f} us"
            "   (blocking pyzmq echo, no asyncio, no validation)"
        )
    if "asyncio_floor_p50_us" in r:
        lines.append(
            f"  asyncio     p50 {r['asyncio_floor_p50_us']:8.1f} us   "
            f"p99 {r['asyncio_floor_p99_us']:8.1f} us   (the echo on our event loop, no protocol)"
        )
    if "ray_p50_us" in r:
        lines.append(
            f"  ray actor   p50 {r['ray_p50_us']:8.1f} us   p99 {r['ray_p99_us']:8.1f} us   "
            f"throughput {r['ray_throughput_rps']:10.0f} calls/s"
        )
        lines.append(f"  p50 speed-up vs Ray: {r['ray_speedup_p50']:.1f}x")
    elif "ray" in r:
        lines.append(f"  ray: {r['ray']}")
    return "\n".join(lines)
