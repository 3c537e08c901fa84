"""The trainer ranks' sealed store (train/trainer_store.py): real sockets, a real server
thread, real gloo groups built on it. Only a process holding the run's secret gets a
session; everything else is closed at its first frame while the ranks go on."""

from __future__ import annotations

import random
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rlix_async.bench.fuzz_store import hostile_connection, sniffed_hello
from rlix_async.train.trainer_store import (
    SECRET_BYTES,
    SealedStore,
    StoreServer,
)

T = timedelta(seconds=10)


@pytest.fixture
def server() -> StoreServer:
    return StoreServer(secrets.token_bytes(SECRET_BYTES), handshake_s=0.5)


def test_a_session_does_what_a_store_does(server: StoreServer) -> None:
    a = SealedStore("127.0.0.1", server.port, server.secret, T)
    b = SealedStore("127.0.0.1", server.port, server.secret, T)
    a.set("batch/0", b"rows")
    assert b.get("batch/0") == b"rows" and b.check(["batch/0"]) and not b.check(["x"])
    assert a.add("beat/0", 1) == 1 and b.add("beat/0", 2) == 3 and a.get("beat/0") == b"3"
    assert a.compare_set("c", b"", b"v1") == b"v1" and a.compare_set("c", b"no", b"v2") == b"v1"
    assert b.num_keys() == 3 and b.delete_key("c") and not b.delete_key("c")
    # a blocking get waits for another session's set; wait() too
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(b.get, "late")
        time.sleep(0.2)
        a.set("late", b"x")
        assert waiting.result(timeout=5) == b"x"
    b.wait(["late", "batch/0"])
    b.set_timeout(timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="not set within"):
        b.get("never")
    assert time.monotonic() - started < 2.0


def test_each_thread_has_its_own_session(server: StoreServer) -> None:
    """Rank 0's heartbeat thread adds while its main thread blocks in get()."""
    store = SealedStore("127.0.0.1", server.port, server.secret, T)
    with ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(store.get, "batch/1")
        time.sleep(0.2)
        for _ in range(5):  # from this thread, while the other one waits
            store.add("beat/0", 1)
        store.set("batch/1", b"ok")
        assert blocked.result(timeout=5) == b"ok"


def test_without_the_secret_a_connection_is_closed_and_the_group_finishes_its_step(
    server: StoreServer,
) -> None:
    """Two ranks (threads, each its own gloo group handle) meet and all-reduce on the
    sealed store while hostile connections arrive: each hostile one is closed without
    a byte beyond the server's nonce, none writes a key, the step completes."""
    with pytest.raises(dist.DistNetworkError, match=r"did not open|closed"):
        SealedStore("127.0.0.1", server.port, secrets.token_bytes(SECRET_BYTES), T)
    replay = sniffed_hello(server.port, server.secret)  # a real session's first frame

    results: list[torch.Tensor] = []
    stop = threading.Event()
    leaked: list[int] = []  # bytes each hostile connection got beyond the server's nonce

    def attack() -> None:
        kinds = ("garbage", "wrong_secret", "replayed", "silent")
        i = 0
        while not stop.is_set():
            leaked.append(hostile_connection(kinds[i % 4], server.port, random.Random(i), replay))
            i += 1

    def rank(r: int) -> None:
        store = SealedStore("127.0.0.1", server.port, server.secret, T)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("step/1", store), r, 2, T)
        t = torch.full((4,), float(r + 1))
        pg.allreduce([t]).wait()
        store.set(f"done/{r}", b"1")
        results.append(t)

    attackers = [threading.Thread(target=attack) for _ in range(3)]
    for a in attackers:
        a.start()
    time.sleep(0.3)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(rank, range(2)))
    stop.set()
    for a in attackers:
        a.join(timeout=10)
    assert [t.tolist() for t in results] == [[3.0] * 4] * 2
    assert len(leaked) >= 8 and not any(leaked), leaked[:3]
    assert server.refused >= len(leaked)
    legit = {k for k in server.stored_keys() if k.startswith(("done/", "step/1"))}
    assert legit == set(server.stored_keys())  # nothing else written by anyone


def test_the_store_survives_a_few_hundred_hostile_connections_while_ranks_use_it() -> None:
    """`rlix-async bench fuzz --target store` in small (PERF has 10,000): every kind
    refused, nothing sent to any, no key of theirs, every batch handed over intact."""
    from rlix_async.bench.fuzz_store import KINDS, fuzz_store

    r = fuzz_store(280, seed=1)
    assert all(r["kinds"][k] > 0 for k in KINDS), r["kinds"]
    assert r["refused"] == 280 and r["bytes_to_hostile"] == 0 and r["foreign_keys"] == []
    assert r["batches_handed_over"] > 0 and r["then_served_intact"] and r["ok"]


def test_connections_held_without_a_handshake_cannot_lock_the_ranks_out() -> None:
    """More silent connections than handshake slots: each new one evicts the oldest, so
    a rank's session (milliseconds to prove itself) still opens."""
    server = StoreServer(secrets.token_bytes(SECRET_BYTES), max_handshakes=4)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(12)]
    try:
        store = SealedStore("127.0.0.1", server.port, server.secret, T)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        deadline = time.monotonic() + 5
        while server.refused < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused >= 8  # the evicted ones
    finally:
        for s in held:
            s.close()


def test_a_call_to_a_store_that_stopped_answering_fails_within_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rank 0's node gone without closing anything: the next call fails in one line
    (within CALL_S) instead of hanging, so train/batches.py can say rank 0 is gone."""
    import rlix_async.train.trainer_store as ts

    server = StoreServer(secrets.token_bytes(SECRET_BYTES))
    store = SealedStore("127.0.0.1", server.port, server.secret, T)
    monkeypatch.setattr(ts, "CALL_S", 0.5)
    monkeypatch.setitem(StoreServer._ops, "check", lambda self, keys: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="timed out"):
        store.check(["k"])
    assert time.monotonic() - started < 5


def test_the_two_directions_of_a_session_never_share_a_nonce() -> None:
    """A request and its reply are sealed under one key: their GCM nonces must differ
    (a repeated nonce under one key gives away both plaintexts and the tag key)."""
    from rlix_async.train.trainer_store import _TO_CLIENT, _TO_SERVER, _Channel

    a, b = socket.socketpair()
    key = secrets.token_bytes(32)
    client, srv = _Channel(a, key, _TO_SERVER, _TO_CLIENT), _Channel(b, key, _TO_CLIENT, _TO_SERVER)
    used: list[bytes] = []
    for channel in (client, srv):
        real = channel.aead

        class Recording:
            def __init__(self, aead) -> None:  # type: ignore[no-untyped-def]
                self.aead = aead

            def encrypt(self, nonce: bytes, data: bytes, aad: None) -> bytes:
                used.append(nonce)
                return self.aead.encrypt(nonce, data, aad)

            def decrypt(self, nonce: bytes, data: bytes, aad: None) -> bytes:
                return self.aead.decrypt(nonce, data, aad)

        channel.aead = Recording(real)  # type: ignore[assignment]
    for i in range(3):
        client.send(["get", f"k{i}"])
        assert srv.receive() == ["get", f"k{i}"]
        srv.send(["ok", i])
        assert client.receive() == ["ok", i]
    assert len(used) == 6 and len(set(used)) == 6
    a.close()
    b.close()
