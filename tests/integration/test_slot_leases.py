"""Readers hold the slot they read (weights/shm.py, "Leases"): the owner never rewrites a
slot under a reader, a dead reader's lease is gone with it, a hung reader's expires
after the owner's ``send_wait_s``, and a load whose lease expired is redone from the
version the slot holds then. Real processes, real shared memory and flocks."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator

import msgspec
import pytest
import torch
from helpers.weights_owner import state

from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.weights.cache import WeightCache

READER = r"""
import sys, msgspec
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.weights.shm import read_slot
from rlix_async.protocols.sinks import SlotOverwritten
ref = msgspec.json.decode(sys.argv[1], type=CacheRef)
with read_slot(ref) as slot:
    slot.check("before")
    print("LEASED", flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            try:
                slot.check("during")
                print("INTACT", flush=True)
            except SlotOverwritten as exc:
                print("OVERWRITTEN", exc, flush=True)
        else:
            break
print("RELEASED", flush=True)
"""


class Reader:
    """Another process holding a reader's lease on the slot of ``ref``."""

    def __init__(self, ref: CacheRef) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", READER, msgspec.json.encode(ref).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.line() == "LEASED"

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def cache() -> Iterator[WeightCache]:
    """Versions 1 (slot 0) and 2 (slot 1, promoted): the next build rewrites slot 0."""
    c = WeightCache(f"t{uuid.uuid4().hex[:6]}", bucket_bytes=4096, send_wait_s=30.0)
    c.build(1, state(1))
    c.promote(1)
    c.build(2, state(2))
    c.promote(2)
    yield c
    c.close()


def _build_in_thread(cache: WeightCache, version: int) -> tuple[threading.Thread, list[float]]:
    done: list[float] = []

    def build() -> None:
        cache.build(version, state(version))
        done.append(time.monotonic())

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    return thread, done


def test_the_owner_waits_for_a_reader_and_writes_as_soon_as_it_leaves(cache: WeightCache) -> None:
    reader = Reader(cache.ref(1))
    try:
        thread, done = _build_in_thread(cache, 3)
        time.sleep(0.5)
        assert not done  # version 1's slot is held: version 3 waits
        reader.say("check")
        assert reader.line() == "INTACT"
        reader.say("release")
        assert reader.line() == "RELEASED"
        left = time.monotonic()
        thread.join(timeout=10)
        # at the release, not at the end of the owner's wait (send_wait_s, 30 s): a
        # bound only the broken rule reaches, whatever the host's load
        assert done and done[0] - left < cache.send_wait_s / 2
    finally:
        reader.close()
    assert cache.ref(3).version == 3 and cache.versions == [3, 2]


def test_a_dead_readers_lease_goes_with_it(cache: WeightCache) -> None:
    reader = Reader(cache.ref(1))
    thread, done = _build_in_thread(cache, 3)
    time.sleep(0.3)
    assert not done
    killed = time.monotonic()
    reader.proc.kill()  # SIGKILL: the kernel drops its flock with its descriptors
    reader.close()
    thread.join(timeout=10)
    assert done and done[0] - killed < cache.send_wait_s / 2  # not the whole wait


def test_a_hung_readers_lease_expires_and_it_finds_its_version_gone(
    cache: WeightCache, caplog: pytest.LogCaptureFixture
) -> None:
    cache.send_wait_s = 1.0
    reader = Reader(cache.ref(1))
    try:
        os.kill(reader.proc.pid, signal.SIGSTOP)  # a shard stuck mid-load
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlix_async.weights.shm"):
            cache.build(3, state(3))  # never longer than send_wait_s on a hung reader
        waited = time.monotonic() - t0
        assert 1.0 <= waited < 5.0
        assert f"still leased by pid {reader.proc.pid}" in caplog.text
        os.kill(reader.proc.pid, signal.SIGCONT)
        reader.say("check")
        assert reader.line().startswith("OVERWRITTEN version 1 was overwritten during")
    finally:
        reader.close()


def test_a_load_whose_lease_expired_is_redone_from_the_version_the_slot_holds(
    cache: WeightCache,
) -> None:
    """weights/staging.py's leased load, as every engine's load on the owner's node runs
    it (vLLM's transfer engine hands it its model's load_weights): here the load records
    the first value of each tensor and, the first time, lets the owner break the lease."""
    from rlix_async.weights.staging import load_leased

    cache.send_wait_s = 0.5
    loads: list[dict[str, float]] = []

    def owner_moves_on() -> None:  # version 3 into slot 0 while we hold it: lease broken
        thread, done = _build_in_thread(cache, 3)
        thread.join(timeout=10)
        assert done

    def load(named: Iterable[tuple[str, torch.Tensor]]) -> None:
        loads.append({n: float(t.flatten()[0]) for n, t in named})
        if len(loads) == 1:
            owner_moves_on()

    loaded, layout = load_leased(cache.ref(1), None, load)
    assert loaded.version == 3 and layout.fingerprint() == loaded.fingerprint
    first, second = loads
    expected = {n: float(t.flatten()[0].float()) for n, t in state(3).items()}
    assert second == expected  # the whole version again, from the slot's new contents
    assert first.keys() == second.keys()
