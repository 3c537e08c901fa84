"""``rlix-async bench fuzz``: hostile input against a listener, then a real use of it.

Target ``env`` (broken environments against the driver) is ``bench/fuzz_env.py``;
target ``store`` (the trainer ranks' sealed store) is ``bench/fuzz_store.py``.

Target ``stream``: the sealed weight stream's plain tcp listener
(``weights/stream.py``), the one door of the weights path that is not behind CURVE.
A real owner (a weight cache in shared memory, version 1 built) serves it. Each input
is one connection of a random kind:

- ``garbage``: random bytes (0-200), then close;
- ``truncated``: the magic and part of a ticket, then close;
- ``guessed``: the magic and a random full ticket;
- ``replayed``: a ticket that already opened its one stream;
- ``loris``: the hello a byte at a time, slower than the hello timeout allows;
- ``silent``: connect and send nothing.

``loris`` and ``silent`` connections are held open several at a time, so the cap on
open connections and the hello timeout are exercised together. Afterwards a granted
stream must land every byte of the version (the listener kept serving and lost
nothing), and no hostile connection may have received a byte of it.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
import uuid
from typing import Any

KINDS = ("garbage", "truncated", "guessed", "replayed", "loris", "silent")


async def _hostile(kind: str, port: int, rng: random.Random, used_ticket: bytes) -> int:
    """One hostile connection; returns the bytes the listener sent back (must be 0)."""
    from rlix_async.weights.stream import MAGIC, TICKET_BYTES

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = 0
    try:
        if kind == "garbage":
            writer.write(rng.randbytes(rng.randrange(0, 201)))
        elif kind == "truncated":
            writer.write(MAGIC + rng.randbytes(rng.randrange(0, TICKET_BYTES)))
        elif kind == "guessed":
            writer.write(MAGIC + rng.randbytes(TICKET_BYTES))
        elif kind == "replayed":
            writer.write(MAGIC + used_ticket)
        elif kind == "loris":
            for byte in (MAGIC + rng.randbytes(TICKET_BYTES))[:6]:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)
        if kind != "silent":
            await writer.drain()
        with_data = await asyncio.wait_for(reader.read(1 << 16), 5.0)
        got = len(with_data)
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()
    return got


async def fuzz_stream(inputs: int, seed: int = 0, concurrency: int = 8) -> dict[str, Any]:
    """``inputs`` hostile connections against a real owner's stream listener, then one
    granted stream checked byte for byte."""
    import torch

    from rlix_async.weights.cache import WeightCache
    from rlix_async.weights.stream import WeightStreamer
    from rlix_async.weights.stream_receiver import receive_stream

    rng = random.Random(seed)
    cache = WeightCache("fuzz", f"fz{uuid.uuid4().hex[:6]}", bucket_bytes=64 << 10)
    g = torch.Generator().manual_seed(seed)
    cache.build(1, {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)})
    cache.promote(1)
    streamer = await WeightStreamer(
        cache, "127.0.0.1", hello_timeout_s=0.2, max_connections=16
    ).start()
    layout = cache.layout
    assert layout is not None
    try:
        used = streamer.grant(1, "fuzz/first")  # opens its one stream, then is replayed
        await receive_stream(f"tcp://127.0.0.1:{used.port}", used, layout, 2, 10, lambda *a: None)
        counts = dict.fromkeys(KINDS, 0)
        leaked = 0
        started = time.perf_counter()
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            nonlocal leaked
            kind = rng.choice(KINDS)
            counts[kind] += 1
            async with sem:
                leaked += await _hostile(kind, streamer.port, rng, used.tickets[0])

        await asyncio.gather(*(one() for _ in range(inputs)))
        hostile_s = time.perf_counter() - started
        landed = bytearray()
        grant = streamer.grant(1, "fuzz/after")
        await receive_stream(
            f"tcp://127.0.0.1:{grant.port}",
            grant,
            layout,
            2,
            10,
            lambda i, header, data: landed.extend(data),
        )
        intact = bytes(landed) == bytes(cache.buffer(1))
        await streamer.wait_sent(2, timeout=10)
    finally:
        await streamer.close()
        cache.close()
    return {
        "target": "stream",
        "inputs": inputs,
        "kinds": counts,
        "refused": streamer.refused,
        "streams_sent": streamer.streams_sent,  # the first stream and the last only
        "bytes_to_hostile": leaked,
        "hostile_s": round(hostile_s, 2),
        "then_served_intact": intact,
        "ok": intact and leaked == 0 and streamer.streams_sent == 2,
    }


def run_fuzz_bench(target: str, inputs: int, seed: int, model: str | None = None) -> dict[str, Any]:
    """``stream`` (this module), ``store`` (``bench/fuzz_store.py``) or ``env``
    (``bench/fuzz_env.py``: ``model`` is a directory whose tokenizer has a chat
    template)."""
    from rlix_async.aio import run

    if target == "env":
        from rlix_async.bench.fuzz_env import fuzz_env

        assert model is not None, "the env target needs a tokenizer directory"
        return run(fuzz_env(model, inputs, seed))
    if target == "store":
        from rlix_async.bench.fuzz_store import fuzz_store

        return fuzz_store(inputs, seed)
    if target != "stream":
        raise ValueError(f"unknown fuzz target {target!r} (stream, env, store)")
    socket.setdefaulttimeout(10)
    return run(fuzz_stream(inputs, seed))
