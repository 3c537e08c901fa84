"""The batch hand-over between trainer ranks (rlix_async/train/batches.py) over rank 0's
real sealed store (train/trainer_store.py), as the ranks meet on it: msgpack checked against the Group schema (never
pickle), keys deleted once every follower is done, and no wait that cannot end: a
follower stops when rank 0 announces its exit or dies, rank 0 when a follower does."""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from rlix_async.protocols.batch import Group
from rlix_async.train.batches import BatchChannel, RankGone
from rlix_async.train.trainer_store import SECRET_BYTES, SealedStore, StoreServer

BATCH = [
    Group([1, 2], [[3, 4], [5]], [[-0.5, -1.25], [-2.0]], [[0, 1], [1]], [1.0, 0.0], 2, "r0-g1"),
    Group([7], [[8], [9]], [[-0.1], [-0.2]], [[1], [1]], [0.5, 0.25], id="r0-g2"),
]


@pytest.fixture
def master() -> Iterator[SealedStore]:
    """Rank 0's sealed store (train/trainer_store.py), as the ranks meet on it."""
    server = StoreServer(secrets.token_bytes(SECRET_BYTES))
    yield SealedStore("127.0.0.1", server.port, server.secret, timedelta(seconds=30))
    server.close()


def _client(master: SealedStore) -> SealedStore:
    return SealedStore("127.0.0.1", master.port, master._secret, timedelta(seconds=30))


def _channel(master: SealedStore, rank: int, **kw: float) -> BatchChannel:
    # bounds short enough that a test whose rule broke fails instead of hanging
    return BatchChannel(
        _client(master), rank, 2, **({"batch_timeout_s": 20.0, "done_timeout_s": 20.0} | kw)
    )


def test_a_batch_crosses_as_msgpack_and_its_keys_are_deleted_after_the_step(
    master: SealedStore,
) -> None:
    rank0, follower = _channel(master, 0), _channel(master, 1)
    keys_before = master.num_keys()
    rank0.post(0, BATCH)
    assert msgspec.msgpack.decode(master.get("batch/0")) == [msgspec.to_builtins(g) for g in BATCH]
    assert follower.receive(0) == BATCH  # every field, the ledger's id included
    follower.done(0)
    rank0.wait_done(0)
    # nothing of the step is left in a store that lives as long as the job
    assert not master.check(["batch/0"]) and not master.check(["done/0/1"])
    assert master.num_keys() == keys_before


def test_bytes_that_are_not_a_batch_fail_naming_the_key_and_run_nothing(
    master: SealedStore, tmp_path: Path
) -> None:
    follower = _channel(master, 1)
    marker = tmp_path / "ran"

    class Payload:  # what anyone who can reach the store could have put there
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    # the right shape, but a response without its log-probs: the Group's own rule
    unaligned = {"prompt": [1], "responses": [[2]], "logprobs": [], "versions": [[0]]}
    bad_group = msgspec.msgpack.encode([unaligned | {"rewards": [0.0]}])
    for version, data, why in (
        (0, pickle.dumps([Payload()]), "Expected `array`"),
        (1, b"\x00garbage", "Expected `array`"),
        (2, bad_group, "responses, logprobs, versions and rewards must align"),
    ):
        master.set(f"batch/{version}", data)
        with pytest.raises(ValueError) as err:
            follower.receive(version)
        msg = str(err.value)
        assert msg.startswith(f"store key batch/{version}: not a batch of trajectory groups"), msg
        assert why in msg and "\n" not in msg
    assert not marker.exists()


def test_a_follower_stops_at_once_when_rank0_announces_its_exit(master: SealedStore) -> None:
    rank0, follower = _channel(master, 0), _channel(master, 1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(follower.receive, 3)
        time.sleep(0.3)
        assert not waiting.done()
        t0 = time.monotonic()
        rank0.announce_exit("failed: RuntimeError: collector stopped")
        with pytest.raises(RankGone, match=r"batch of step 4: rank 0 stopped \(failed: Runtime"):
            waiting.result(timeout=10)
        assert time.monotonic() - t0 < 3  # a second or so, not the hour a batch may take


BEATING = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from rlix_async.train.batches import BatchChannel
from rlix_async.train.trainer_store import SealedStore
store = SealedStore("127.0.0.1", int(sys.argv[1]), bytes.fromhex(sys.argv[2]), timedelta(seconds=30))
BatchChannel(store, 0, 2, beat_s=0.2).start_beat()
print("beating", flush=True)
time.sleep(300)
"""


def test_a_follower_waits_while_rank0_beats_and_stops_once_it_is_killed(
    master: SealedStore,
) -> None:
    rank0 = subprocess.Popen(
        [sys.executable, "-c", BEATING, str(master.port), master._secret.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank0.stdout is not None and rank0.stdout.readline() == "beating\n"
        follower = _channel(master, 1, silent_s=1.5)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(follower.receive, 0)
            time.sleep(3.0)  # twice the silence allowed: the beat keeps it waiting
            assert not waiting.done()
            os.kill(rank0.pid, signal.SIGKILL)  # gone without a word
            t0 = time.monotonic()
            with pytest.raises(
                RankGone, match=r"rank 0 silent for [1-3] s \(no beat\): it is gone"
            ):
                waiting.result(timeout=15)
            assert time.monotonic() - t0 < 5
    finally:
        rank0.kill()
        rank0.wait(timeout=10)


HOSTING = """
import secrets, time
from rlix_async.train.trainer_store import StoreServer
server = StoreServer(secrets.token_bytes(32))
print(server.port, server.secret.hex(), flush=True)
time.sleep(300)
"""


def test_a_follower_stops_in_one_line_when_rank0_takes_the_store_with_it() -> None:
    """The ranks' store lives in rank 0's process (train/rendezvous.py): when that
    process dies, a waiting follower stops at its next look, naming why."""
    rank0 = subprocess.Popen([sys.executable, "-c", HOSTING], stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout is not None
        port, secret = rank0.stdout.readline().split()
        store = SealedStore("127.0.0.1", int(port), bytes.fromhex(secret), timedelta(seconds=30))
        follower = BatchChannel(store, 1, 2)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(follower.receive, 0)
            time.sleep(1.0)
            assert not waiting.done()
            os.kill(rank0.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RankGone, match=r"batch of step 1: the ranks' store is gone"):
                waiting.result(timeout=15)
            assert time.monotonic() - t0 < 5
    finally:
        rank0.kill()
        rank0.wait(timeout=10)


def test_every_wait_has_a_bound(master: SealedStore) -> None:
    follower = _channel(master, 1, batch_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"batch of step 1: nothing after 0 s \(batch/0\)"):
        follower.receive(0)
    assert time.monotonic() - t0 < 3
    rank0 = _channel(master, 0, done_timeout_s=0.5)
    with pytest.raises(TimeoutError, match=r"offload after step 1: nothing after 0 s"):
        rank0.wait_done(0)


def test_rank0_stops_waiting_for_a_follower_that_failed_but_not_for_one_that_finished(
    master: SealedStore,
) -> None:
    rank0, follower = _channel(master, 0), _channel(master, 1)
    follower.announce_exit("failed: OSError: out of memory")
    with pytest.raises(RankGone, match=r"rank 1 stopped \(failed: OSError: out of memory\)"):
        rank0.wait_done(0)
    follower.done(1)  # its last step: done, then gone
    follower.announce_exit("finished")
    rank0.wait_done(1)
