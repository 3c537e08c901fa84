"""``rlix-async bench rpc``: round trip and pipelined throughput between two processes.

The server runs in a child process (spawned, its own event loop); the client in
this one times ``Ping -> Pong`` calls one at a time (p50/p99), then keeps a window
of calls in flight (throughput). With ``--vs-ray`` the same call pattern runs
against a Ray actor in the same run, so the comparison shares the machine state.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from rlix_async.aio import run as aio_run
from rlix_async.protocol import Ping, Pong
from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint, keygen
from rlix_async.transport import RpcClient, RpcServer


@dataclass(frozen=True)
class RpcBenchConfig:
    transport: str = "ipc"
    calls: int = 5000
    warmup: int = 500
    window: int = 64
    throughput_s: float = 2.0
    vs_ray: bool = False


def _percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _serve(endpoint: str, keys_dir: str | None, ready: Any, stop: Any) -> None:
    async def main() -> None:
        keys = ServerKeys.load(keys_dir) if keys_dir else None
        server = RpcServer(endpoint, keys=keys, name="bench-server")
        server.on(Ping, lambda msg, ctx: Pong(seq=msg.seq))
        await server.start()
        ready.put(server.endpoint)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, stop.wait)
        await server.close()

    aio_run(main())


async def _measure_rpc(
    endpoint: str, keys: ClientKeys | None, cfg: RpcBenchConfig
) -> dict[str, float]:
    client = await RpcClient(endpoint, "bench/client/0", keys=keys).connect(timeout=30)
    try:
        for i in range(cfg.warmup):
            await client.call(Ping(seq=i))
        lat: list[float] = []
        for i in range(cfg.calls):
            t0 = time.perf_counter_ns()
            await client.call(Ping(seq=i))
            lat.append((time.perf_counter_ns() - t0) / 1000)
        done = 0
        deadline = time.perf_counter() + cfg.throughput_s

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await client.call(Ping(seq=done))
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cfg.window)))
        elapsed = time.perf_counter() - t0
    finally:
        await client.close()
    lat.sort()
    return {
        "p50_us": _percentile(lat, 0.50),
        "p99_us": _percentile(lat, 0.99),
        "mean_us": statistics.fmean(lat),
        "throughput_rps": done / elapsed,
    }


def _measure_ray(cfg: RpcBenchConfig) -> dict[str, float]:
    import ray

    @ray.remote
    class Echo:
        def ping(self, seq: int) -> int:
            return seq

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actor = Echo.remote()  # type: ignore[attr-defined]
        for i in range(cfg.warmup):
            ray.get(actor.ping.remote(i))
        lat: list[float] = []
        for i in range(cfg.calls):
            t0 = time.perf_counter_ns()
            ray.get(actor.ping.remote(i))
            lat.append((time.perf_counter_ns() - t0) / 1000)
        done = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < cfg.throughput_s:
            ray.get([actor.ping.remote(i) for i in range(cfg.window)])
            done += cfg.window
        elapsed = time.perf_counter() - t0
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


def _measure_zmq_floor(cfg: RpcBenchConfig) -> dict[str, float]:
    """Plain blocking pyzmq echo between two processes: the floor under any ZMQ RPC."""
    import zmq

    ctx_mp = mp.get_context("spawn")
    endpoint = ipc_endpoint(f"bench-raw-{time.time_ns()}")
    ready = ctx_mp.Queue()
    proc = ctx_mp.Process(target=_raw_echo, args=(endpoint, ready), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(ready.get(timeout=60))
        payload = b"\x94\x01\x01\xa4Ping\x81\xa3seq\x01"  # a Ping-sized msgpack frame
        for _ in range(cfg.warmup):
            sock.send(payload)
            sock.recv()
        lat: list[float] = []
        for _ in range(cfg.calls):
            t0 = time.perf_counter_ns()
            sock.send(payload)
            sock.recv()
            lat.append((time.perf_counter_ns() - t0) / 1000)
        sock.send(b"stop")
    finally:
        sock.close()
        ctx.term()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    lat.sort()
    return {"zmq_floor_p50_us": _percentile(lat, 0.50), "zmq_floor_p99_us": _percentile(lat, 0.99)}


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
        ready, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_serve, args=(endpoint, keys_dir, ready, stop), daemon=True)
        proc.start()
        try:
            bound = ready.get(timeout=60)
            keys = ClientKeys.load(keys_dir) if keys_dir else None
            result: dict[str, Any] = {
                "transport": cfg.transport,
                "calls": cfg.calls,
                "window": cfg.window,
            }
            result.update(aio_run(_measure_rpc(bound, keys, cfg)))
        finally:
            stop.set()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if cfg.transport == "ipc":
        result.update(_measure_zmq_floor(cfg))
    if cfg.vs_ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            result["ray"] = "not installed (pip install 'rlix_async[bench]')"
        else:
            result.update(_measure_ray(cfg))
            result["ray_speedup_p50"] = result["ray_p50_us"] / result["p50_us"]
    return result


def format_rpc_result(r: dict[str, Any]) -> str:
    lines = [
        f"transport {r['transport']}: {r['calls']} sequential calls, window {r['window']}",
        f"  rlix_async  p50 {r['p50_us']:8.1f} us   p99 {r['p99_us']:8.1f} us   "
        f"throughput {r['throughput_rps']:10.0f} calls/s",
    ]
    if "zmq_floor_p50_us" in r:
        lines.append(
            f"  zmq floor   p50 {r['zmq_floor_p50_us']:8.1f} us   p99 {r['zmq_floor_p99_us']:8.1f} us"
            "   (blocking pyzmq echo, no asyncio, no validation)"
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
