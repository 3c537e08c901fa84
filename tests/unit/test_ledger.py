"""The trajectory ledger (rlix_async/rollout/ledger.py): written by the real writer to a real
file, replayed by ``tally``. Each test is one history a pipeline can go through; the
counts are worked out by hand in its comments."""

from __future__ import annotations

from pathlib import Path

from rlix_async.protocols.batch import Group
from rlix_async.rollout.ledger import Ledger, Tally, read_events, tally


def _group(gid: str, n: int = 2) -> Group:
    return Group([1], [[5]] * n, [[-1.0]] * n, [[0]] * n, [0.0] * n, id=gid)


def _start(
    path: Path, *, fresh: bool, from_step: int = 0, buffered: tuple[str, ...] = ()
) -> Ledger:
    return Ledger(path, fresh=fresh, from_step=from_step, buffered=[_group(g) for g in buffered])


def _collect(ledger: Ledger, version: int, k: int = 1) -> list[Group]:
    """``k`` groups of 2 requested and buffered at ``version``."""
    out = []
    for _ in range(k):
        gid = ledger.new_id()
        ledger.requested(gid, 2, version)
        ledger.finished(gid, 2, 0, 0, "buffered")
        out.append(_group(gid))
    return out


def _balanced(t: Tally) -> bool:
    placed = (
        t.trained + t.dropped_stale + t.cancelled_stale + t.left_over + t.pending + t.lost
    ) + t.filtered
    return t.requested == placed


def test_a_clean_run_trains_what_it_took_and_leaves_the_rest_over(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    a, b, c = _collect(led, 0, 3)
    led.requested(in_flight := led.new_id(), 2, 1)
    led.taken([a, b], 0)
    led.checkpoint(1, [c])
    led.end(1)
    led.close()
    t = tally(path)
    assert (t.requested, t.trained, t.left_over, t.lost, t.pending) == (8, 4, 4, 0, 0)
    assert t.generated == 6  # the group in flight never came back
    assert in_flight == "r0-g4" and _balanced(t)


def test_a_step_trained_after_the_last_checkpoint_is_lost_when_a_kill_rolls_it_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    g1, g2, g3 = _collect(led, 0, 3)
    led.taken([g1], 0)
    led.checkpoint(1, [g2, g3])  # step 1 saved with g2, g3 in its buffer
    led.taken([g2], 1)  # step 2 trains g2 ... and is killed before its checkpoint
    _collect(led, 1)  # g4: finished after the checkpoint, not in it
    led.requested(led.new_id(), 2, 1)  # in flight at the kill
    # (killed: no close, no end)
    before = tally(path)
    assert (before.trained, before.pending, before.lost) == (2, 8, 0)  # not over yet
    led = _start(path, fresh=False, from_step=1, buffered=("r0-g2", "r0-g3"))
    assert led.run == 1
    g5, g6 = _collect(led, 1, 2)
    led.taken([_group("r0-g2"), g5], 1)
    led.checkpoint(2, [_group("r0-g3"), g6])
    led.end(2)
    t = tally(path)
    # g1 (step 1) and g2 + g5 (step 2, after the restart) trained; g3 and g6 left over;
    # g4 (finished after the checkpoint) and the group in flight lost; g2 came back
    assert (t.trained, t.left_over, t.lost_to_restarts, t.lost) == (6, 4, 4, 4)
    assert (t.requested, t.restarts) == (14, 1) and _balanced(t)


def test_a_checkpoint_on_disk_without_its_ledger_line_still_counts_as_trained(
    tmp_path: Path,
) -> None:
    """Killed between writing the checkpoint and its ledger line: the restart resumes
    from that step, so what was taken before it is trained, not lost."""
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    g1, g2 = _collect(led, 0, 2)
    led.taken([g1], 0)
    led.taken([g2], 1)  # step 2 taken; its checkpoint written, its line never
    led = _start(path, fresh=False, from_step=2)
    led.end(2)
    t = tally(path)
    assert (t.trained, t.lost) == (4, 0)


def test_a_group_dropped_after_the_checkpoint_comes_back_with_its_buffer(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    g1, g2 = _collect(led, 0, 2)
    led.taken([g1], 0)
    led.checkpoint(1, [g2])
    led.dropped([g2], 3)  # dropped as stale after the checkpoint, then killed
    assert tally(path).dropped_stale == 2
    led = _start(path, fresh=False, from_step=1, buffered=("r0-g2",))
    led.taken([g2], 1)
    led.checkpoint(2, [])
    led.end(2)
    t = tally(path)
    assert (t.trained, t.dropped_stale, t.lost) == (4, 0, 0)


def test_failures_discards_and_stale_groups_are_each_counted(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    for ok, failed, cancelled, outcome in (
        (3, 1, 0, "buffered"),  # one failed: lost; three buffered (left over at the end)
        (1, 3, 0, "unusable"),  # one answer cannot be compared: discarded
        (1, 0, 3, "stale"),  # stopped early: one finished and dropped, three cancelled
    ):
        led.requested(gid := led.new_id(), 4, 0)
        led.finished(gid, ok, failed, cancelled, outcome)
    led.end(0)
    t = tally(path)
    assert (t.failed, t.discarded, t.dropped_stale, t.cancelled_stale) == (4, 1, 1, 3)
    assert (t.left_over, t.lost, t.generated) == (3, 5, 5) and _balanced(t)


def test_a_group_filtered_for_equal_rewards_is_counted_and_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    led.requested(gid := led.new_id(), 4, 0)
    led.finished(gid, 4, 0, 0, "filtered")  # all four scored alike: dropped by choice
    led.requested(gid := led.new_id(), 4, 0)
    led.finished(gid, 3, 1, 0, "filtered")  # one failed (lost), three filtered
    led.end(0)
    t = tally(path)
    assert (t.filtered, t.failed, t.lost, t.discarded) == (7, 1, 1, 0) and _balanced(t)


def test_a_resume_without_a_checkpoint_loses_everything_and_a_fresh_run_starts_over(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    _collect(led, 0, 2)
    led = _start(path, fresh=False, from_step=0)  # --resume, nothing saved yet
    assert tally(path).lost_to_restarts == 4
    led = _start(path, fresh=True)  # a new run in the same directory
    assert led.run == 2  # ids stay unique across the file
    _collect(led, 0)
    assert tally(path) == Tally(requested=2, generated=2, pending=2)


def test_events_after_the_end_and_a_torn_last_line_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    led = _start(path, fresh=True)
    (g,) = _collect(led, 0)
    led.taken([g], 0)
    led.checkpoint(1, [])
    led.end(1)
    led.requested("late", 2, 1)  # a request racing the shutdown
    led.close()
    with open(path, "a") as fh:
        fh.write('{"ev":"requested","g":"torn"')  # a crash mid-line
    assert [e["ev"] for e in read_events(path)][-1] == "requested"
    assert tally(path) == Tally(requested=2, generated=2, trained=2)


def test_a_torn_last_line_is_cut_before_the_next_run_appends(tmp_path: Path) -> None:
    """A crash mid-write leaves a fragment; the next Ledger must not glue its start
    line onto it (which made every later read fail)."""
    from rlix_async.rollout.ledger import Ledger, read_events

    path = tmp_path / "ledger.jsonl"
    Ledger(path, fresh=True, from_step=0, buffered=[]).close()
    with open(path, "ab") as fh:
        fh.write(b'{"ev":"requested","gro')  # torn
    Ledger(path, fresh=False, from_step=0, buffered=[]).close()
    events = list(read_events(path))
    assert [e["ev"] for e in events].count("start") == 2
    assert all(line.startswith(b"{") for line in path.read_bytes().splitlines())
