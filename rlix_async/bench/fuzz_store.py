"""``rlix-async bench fuzz --target store``: hostile connections against the trainer
ranks' sealed store (``train/trainer_store.py``) while two ranks use it.

A real :class:`StoreServer` (a fresh secret, a short handshake time so held
connections cost the run little) serves two rank sessions that hand batches over and
beat, as ``train/batches.py`` does, for the whole run. Each input is one connection of
a random kind:

- ``garbage``: random bytes (0-200), then close;
- ``truncated``: the magic and part of a nonce, then close;
- ``wrong_secret``: a full handshake, then a sealed hello under another secret;
- ``replayed``: a real session's sealed hello, sent in a new session;
- ``forged``: a valid handshake, then a frame of random bytes claiming any length;
- ``loris``: the hello a byte at a time, slower than the handshake time allows;
- ``silent``: connect and send nothing.

Afterwards: no hostile connection got a byte beyond the server's nonce, every one was
refused, no key exists that the ranks did not write, every batch the ranks handed
over arrived intact, and a new rank session still works.
"""

from __future__ import annotations

import random
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

KINDS = ("garbage", "truncated", "wrong_secret", "replayed", "forged", "loris", "silent")


def hostile_connection(kind: str, port: int, rng: random.Random, replay: bytes) -> int:
    """One hostile connection; the bytes the server sent beyond its nonce (must be 0)."""
    from rlix_async.train.trainer_store import MAGIC, NONCE_BYTES, client_session

    got = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            if kind == "garbage":
                sock.sendall(rng.randbytes(rng.randrange(0, 201)))
            elif kind == "truncated":
                sock.sendall(MAGIC + rng.randbytes(rng.randrange(0, NONCE_BYTES)))
            elif kind == "loris":
                for byte in (MAGIC + rng.randbytes(NONCE_BYTES))[:6]:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.05)
            elif kind == "wrong_secret":
                client_session(sock, rng.randbytes(32)).send(["hello"])
            elif kind in ("replayed", "forged"):  # a valid handshake, then a frame of ours
                sock.sendall(MAGIC + rng.randbytes(NONCE_BYTES))
                sock.recv(NONCE_BYTES)
                forged = rng.randbytes(4) + rng.randbytes(rng.randrange(0, 100))
                sock.sendall(replay if kind == "replayed" else forged)
            if kind in ("garbage", "truncated"):
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):
                got += len(chunk)
        except OSError:
            pass
    return got


def sniffed_hello(port: int, secret: bytes) -> bytes:
    """A real session's first sealed frame, as it crossed the wire (to replay)."""
    from rlix_async.train.trainer_store import client_session

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        channel = client_session(sock, secret)
        wire = bytearray()

        class Tap:
            def sendall(self, data: bytes) -> None:
                wire.extend(data)
                sock.sendall(data)

        channel.sock = Tap()  # type: ignore[assignment]
        channel.send(["hello"])
    return bytes(wire)


def fuzz_store(inputs: int, seed: int = 0, concurrency: int = 8) -> dict[str, Any]:
    from rlix_async.train.trainer_store import SECRET_BYTES, SealedStore, StoreServer

    rng = random.Random(seed)
    secret = secrets.token_bytes(SECRET_BYTES)
    server = StoreServer(secret, handshake_s=0.2, max_handshakes=16)
    replay = sniffed_hello(server.port, secret)
    refused_before = server.refused
    t = timedelta(seconds=30)
    leader = SealedStore("127.0.0.1", server.port, secret, t)
    follower = SealedStore("127.0.0.1", server.port, secret, t)
    stop = threading.Event()
    handed: list[bytes] = []
    received: list[bytes] = []

    def ranks() -> None:  # rank 0 posts batches and beats, rank 1 takes them
        step = 0
        while not stop.is_set():
            batch = secrets.token_bytes(4096)
            leader.set(f"batch/{step}", batch)
            leader.add("beat/0", 1)
            received.append(follower.get(f"batch/{step}"))
            follower.set(f"done/{step}/1", b"1")
            handed.append(batch)
            step += 1
            time.sleep(0.01)

    counts = dict.fromkeys(KINDS, 0)
    kinds = [rng.choice(KINDS) for _ in range(inputs)]
    for k in kinds:
        counts[k] += 1
    seeds = [rng.randrange(1 << 30) for _ in range(inputs)]
    started = time.perf_counter()
    user = threading.Thread(target=ranks, daemon=True)
    user.start()
    with ThreadPoolExecutor(concurrency) as pool:
        leaked = sum(
            pool.map(lambda i: hostile_connection(kinds[i], server.port, random.Random(seeds[i]), replay),
                     range(inputs))
        )  # fmt: skip
    stop.set()
    user.join(timeout=30)
    hostile_s = time.perf_counter() - started
    deadline = time.monotonic() + 5  # the last held handshakes time out
    while server.refused - refused_before < inputs and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = SealedStore("127.0.0.1", server.port, secret, t)  # a rank joining afterwards
    fresh.set("after", b"ok")
    intact = received == handed and fresh.get("after") == b"ok"
    ours = {"beat/0", "after"} | {f"batch/{i}" for i in range(len(handed))}
    ours |= {f"done/{i}/1" for i in range(len(handed))}
    foreign = sorted(set(server.stored_keys()) - ours)
    server.close()
    return {
        "target": "store",
        "inputs": inputs,
        "kinds": counts,
        "refused": server.refused - refused_before,
        "bytes_to_hostile": leaked,
        "hostile_s": round(hostile_s, 2),
        "batches_handed_over": len(handed),
        "foreign_keys": foreign,
        "then_served_intact": intact,
        "ok": intact and leaked == 0 and not foreign and server.refused - refused_before == inputs,
    }
