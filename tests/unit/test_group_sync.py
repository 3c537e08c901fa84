"""Group commit on a real journal file: lease events recorded by the handlers of one
loop turn are made durable by one fsync, and no reply goes out before it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rlix_async.control import journal as ev
from rlix_async.control.journal import Journal, JournalWriteError, SharedFsync
from rlix_async.transport import Deferred


def answers(later: object) -> list[tuple[object, Exception | None]]:
    """What a Deferred is answered with, as the transport would see it."""
    assert isinstance(later, Deferred)
    got: list[tuple[object, Exception | None]] = []
    later.on_done(lambda reply, exc: got.append((reply, exc)))
    return got


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the journal's fsyncs (and still does them)."""
    calls: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return calls


async def test_the_releases_of_one_turn_share_one_fsync_and_wait_for_it(
    tmp_path: Path, fsyncs: list[int]
) -> None:
    journal = Journal(tmp_path / "j.jsonl", fsync="leases")
    group = SharedFsync(lambda: journal)
    before = len(fsyncs)
    got = []
    for i in range(5):
        journal.record(ev.Released(pipeline=f"p{i}", cluster="actor_train"), sync=False)
        got.append(answers(group.reply_after(f"ok {i}")))
    assert len(fsyncs) == before  # not yet: the turn is not over
    assert got == [[]] * 5
    await asyncio.sleep(0)  # the next turn: one fsync, then every answer
    assert got == [[(f"ok {i}", None)] for i in range(5)]
    assert len(fsyncs) == before + 1 and group.syncs == 1
    assert not journal.unsynced
    lines = (tmp_path / "j.jsonl").read_text().splitlines()
    assert sum('"release"' in line for line in lines) == 5
    journal.close()


async def test_nothing_to_sync_replies_at_once(tmp_path: Path, fsyncs: list[int]) -> None:
    journal = Journal(tmp_path / "j.jsonl", fsync="leases")
    group = SharedFsync(lambda: journal)
    journal.record(
        ev.Requested(pipeline="p", cluster="actor_train", priority="ACTOR_TRAINING", seq=1)
    )
    assert group.reply_after("ok") == "ok"  # progress-like events are not fsynced
    journal.close()


async def test_a_failed_group_fsync_fails_every_reply_waiting_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j.jsonl", fsync="leases")
    group = SharedFsync(lambda: journal)
    journal.record(ev.Released(pipeline="p", cluster="actor_train"), sync=False)
    got = [answers(group.reply_after(1)), answers(group.reply_after(2))]

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    await asyncio.sleep(0)
    for answer in got:
        [(reply, exc)] = answer
        assert reply is None and isinstance(exc, JournalWriteError)
        assert "fsync failed" in str(exc)
