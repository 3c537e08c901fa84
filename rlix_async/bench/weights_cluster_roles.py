"""The processes of ``rlix-async bench weights --hosts N`` on its hosts (network
namespaces): the owner (host 0) and the shard workers (hosts 1..N), each started as
``python -m rlix_async.bench.weights_cluster_roles ROLE ...`` by the benchmark's driver
(``bench/weights_cluster.py``, which says what is measured). They meet the driver
through files in a shared directory: ``go-V``, ``ref-V.json``, ``wake-V``,
``done-V-NAME.json``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from rlix_async.protocols.cache_ref import CacheRef

MIB = 1 << 20
PIPELINE = "bench"
WAIT_S = 600.0  # any one wait of the benchmark


def _wait_for(path: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.005)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(data))
    tmp.replace(path)


# --- processes on the hosts ----------------------------------------------------------


def owner(
    d: Path,
    keys: str,
    address: str,
    model_mb: int,
    bucket_mb: int,
    transport: str,
    streams: int,
    delta: float = 0.0,
) -> None:
    """Host 0: build each version when asked (``go-V``), publish its ref (``ref-V``)."""
    import asyncio

    import torch

    from rlix_async.bench.weights import model_like
    from rlix_async.security import ServerKeys
    from rlix_async.weights.cache import WeightCache
    from rlix_async.weights.delta_source import VersionDeltas
    from rlix_async.weights.tcp import WeightServer

    tensors = model_like(model_mb * MIB)
    g = torch.Generator().manual_seed(0)
    moving = {n: torch.rand(t.shape, generator=g) < delta for n, t in tensors.items()}

    async def serve() -> None:
        cache = WeightCache(PIPELINE, "rank0", bucket_bytes=bucket_mb * MIB)
        deltas = VersionDeltas(cache) if delta else None
        server_keys = ServerKeys.load(keys, f"driver-{PIPELINE}")
        server = await WeightServer(
            cache, f"tcp://{address}:0", keys=server_keys, streams=streams, deltas=deltas
        ).start()
        cache.serve(server.endpoint, server_keys.public.decode(), transport=transport)
        try:
            version = 1
            while not (d / "stop").exists():
                if not (d / f"go-{version}").exists():
                    await asyncio.sleep(0.005)
                    continue
                for name, t in tensors.items():
                    if delta:  # the moving elements hold the version, the rest 0.5
                        t.fill_(0.5).masked_fill_(moving[name], float(version))
                    else:
                        t.fill_(float(version))
                if deltas is not None:
                    deltas.stop()
                cache.build(version, tensors)
                if deltas is not None:
                    deltas.encode(version)
                ref = cache.promote(version)
                published = {"ref": ref, "published": time.time(), "sparse": bool(delta)}
                _write_json(d / f"ref-{version}.json", published)
                version += 1
        finally:
            await server.close()
            cache.close()

    asyncio.run(serve())


def worker(
    d: Path, keys: str, name: str, rank: int, tp: int, first: int, last: int, asleep: bool
) -> None:
    """One tensor-parallel rank of a shard: load versions ``first..last`` as published
    (``asleep``: each only once woken, ``wake-V``, as a sleeping shard syncs at its wake)."""
    import torch

    from rlix_async.protocols.sinks import SyncError
    from rlix_async.security import ClientKeys
    from rlix_async.weights.staging import fetch_version, load_fetched

    client = ClientKeys.load(keys, "shard")
    model: dict[str, torch.Tensor] = {}  # stands in for vLLM's model: this rank's slices

    def load(named: Any) -> None:
        for tensor_name, t in named:
            part = t.narrow(0, rank * (t.shape[0] // tp), t.shape[0] // tp) if tp > 1 else t
            if tensor_name not in model:
                model[tensor_name] = torch.empty_like(part)
            model[tensor_name].copy_(part)

    layout = None
    for version in range(first, last + 1):
        _wait_for(d / f"ref-{version}.json")
        published = msgspec.json.decode((d / f"ref-{version}.json").read_bytes())
        ref = msgspec.convert(published["ref"], CacheRef)
        if asleep:
            _wait_for(d / f"wake-{version}")
        t0 = time.time()
        # (no sampler here: the driver samples each host's memory, and a sampling thread
        # in each of 20 workers would take the cores the transfer is measured on)
        retries = 0
        while True:  # a failed sync is retried, as the coordinator retries a shard's
            try:
                fetched = fetch_version(ref, layout, load, keys=client)
                staged_bytes = fetched.staged_bytes
                fetched = load_fetched(fetched, load)  # as at finish_weight_update
                break
            except SyncError as exc:
                retries += 1
                print(f"sync of version {version} failed ({exc}); retrying", flush=True)
                if retries > 5:
                    raise
        layout = fetched.layout
        del fetched  # the private copy, where there was one
        finished = time.time()
        # the owner fills version V with V (--delta: V or 0.5): anything else is part of
        # another version
        v = float(version)
        if published.get("sparse"):
            whole = all(bool(((t == v) | (t == 0.5)).all()) for t in model.values())
        else:
            whole = all(bool((t == v).all()) for t in model.values())
        _write_json(
            d / f"done-{version}-{name}.json",
            {
                "seconds": finished - t0,
                "done": finished,
                "staged_bytes": staged_bytes,
                "retries": retries,
                "torn": not whole,
            },
        )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="rlix_async.bench.weights_cluster_roles")
    sub = p.add_subparsers(dest="role", required=True)
    o = sub.add_parser("owner")
    for name in ("dir", "keys", "address"):
        o.add_argument(name)
    o.add_argument("model_mb", type=int)
    o.add_argument("bucket_mb", type=int)
    o.add_argument("transport")
    o.add_argument("streams", type=int)
    o.add_argument("delta", type=float)
    w = sub.add_parser("worker")
    for name in ("dir", "keys", "name"):
        w.add_argument(name)
    for name in ("rank", "tp", "first", "last"):
        w.add_argument(name, type=int)
    w.add_argument("asleep", choices=["asleep", "awake"])
    args = p.parse_args(argv)
    if args.role == "owner":
        owner(
            Path(args.dir), args.keys, args.address, args.model_mb, args.bucket_mb,
            args.transport, args.streams, args.delta,
        )  # fmt: skip
    else:
        worker(
            Path(args.dir), args.keys, args.name, args.rank, args.tp, args.first, args.last,
            args.asleep == "asleep",
        )  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
    print(json.dumps({"ok": True}))
