"""What the remote-weights tests share: a fresh sink, pipeline ``p``'s keys and cache,
a WeightServer serving it the way a trainer does, and a tcp proxy on a stream's path."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch

from helpers.weights_owner import state
from rlix_async.security import ClientKeys, ServerKeys, keygen
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.node_cache import NodeCache
from rlix_async.weights.sinks import TensorSink
from rlix_async.weights.stream import DeltaProvider
from rlix_async.weights.tcp import WeightServer


def fresh() -> TensorSink:
    return TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})


def make_keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    keygen(d, ["driver-p"], role="driver", pipelines=["p"])
    keygen(d, ["shard"], role="shard", pipelines=["p"])
    keygen(d, ["shard-other"], role="shard", pipelines=["other"])
    keygen(d, ["shard-any"], role="shard", pipelines=["*"])
    return d


def make_cache(send_wait_s: float = 5.0) -> WeightCache:
    """Pipeline ``p``'s cache with version 1 (segments named uniquely per test)."""
    cache = WeightCache("p", f"o{uuid.uuid4().hex[:6]}", bucket_bytes=4096, send_wait_s=send_wait_s)
    cache.build(1, state(1))
    cache.promote(1)
    return cache


def machine_dirs(tmp_path: Path, n: int) -> list[Path]:
    """``n`` shared-memory directories, one per node (as ``n`` machines)."""
    out = []
    for i in range(n):
        d = tmp_path / f"node{i}"
        d.mkdir(mode=0o700)
        out.append(d)
    return out


def relaying_node(keys: Path, shm_dir: Path, cls: type[NodeCache] = NodeCache) -> NodeCache:
    """Pipeline ``p``'s node cache that relays (as ``launch --node`` starts one), its
    shared memory in ``shm_dir``."""
    return cls(
        "p",
        keys=ClientKeys.load(keys, "shard"),
        shm_dir=shm_dir,
        relay_address="127.0.0.1",
        server_keys=ServerKeys.load(keys, "shard"),
    )


@contextlib.asynccontextmanager
async def serving(
    cache: WeightCache,
    keys: Path,
    cls: type[WeightServer] = WeightServer,
    *,
    streams: int = 1,
    transport: str = "sealed",
    deltas: DeltaProvider | None = None,
) -> AsyncIterator[WeightServer]:
    """Serve ``cache`` as a trainer does (pipeline.Driver._serve_weights): tcp, with its
    driver's key pair, whose public key every ref then carries (and ``transport``, the
    pipeline's weights.transport)."""
    server_keys = ServerKeys.load(keys, "driver-p")
    extra = {} if deltas is None else {"deltas": deltas}  # (a relay takes no deltas of ours)
    server = await cls(
        cache, "tcp://127.0.0.1:0", keys=server_keys, streams=streams, **extra
    ).start()
    cache.serve(server.endpoint, server_keys.public.decode(), transport)
    try:
        yield server
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def proxy(
    port: int, alter: Callable[[int, bytes], bytes | None]
) -> AsyncIterator[tuple[int, bytearray]]:
    """A tcp proxy to 127.0.0.1:port. ``alter(offset, chunk)`` sees every chunk the
    owner sends (its offset in the stream) and returns what to forward, or None to cut
    the connection. Yields the proxy's port and everything the owner sent."""
    seen = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", port)

        async def upstream() -> None:
            while data := await reader.read(1 << 16):
                up_w.write(data)
                await up_w.drain()

        async def downstream() -> None:
            while data := await up_r.read(1 << 16):
                out = alter(len(seen), data)
                seen.extend(data)
                if out is None:
                    return
                writer.write(out)
                await writer.drain()

        up = asyncio.ensure_future(upstream())
        try:
            await downstream()
        finally:
            up.cancel()
            writer.close()
            up_w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
