"""The journal's typed events: one vocabulary for the coordinator, the replay, the
timeline and the simulator; files written by earlier versions still replay. And the
journal survives anything (docs/JOURNAL.md): damaged lines and tails, events that no
longer apply, failed writes; lease events are fsynced; a long journal is compacted."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from rlix_async.control import journal as ev
from rlix_async.control.registry import Registry
from rlix_async.observe.timeline import spans
from rlix_async.protocols.topology import ClusterShape, ClusterSpec, Priority

TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0, 1, 2))}


def _run(path: Path) -> list[ev.Event]:
    clock = iter(range(100, 200))
    j = ev.Journal(path, clock=lambda: float(next(clock)))
    events: list[ev.Event] = [
        ev.Registered(pipeline="A", clusters=TOPO),
        ev.Admitted(pipeline="A"),
        ev.Requested(pipeline="A", cluster="actor_train", priority="ACTOR_TRAINING", seq=1),
        ev.Expanded(pipeline="A", cluster="actor_infer", ranks=[1, 2], devices=[1, 2]),
        ev.Granted(pipeline="A", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0]),
        ev.ProgressReported(pipeline="A", stream="default", target=64, completed=10),
        ev.WeightsPublished(pipeline="A", version=3),
        ev.ShardSynced(pipeline="A", rank=1, version=3),
        ev.Shrunk(pipeline="A", cluster="actor_infer", ranks=[2], devices=[2]),
        ev.Released(pipeline="A", cluster="actor_train"),
    ]
    for e in events:
        j.record(e)
    j.close()
    return events


def test_events_round_trip_and_replay_into_a_registry(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    written = _run(path)
    read = list(ev.read_journal(path))
    assert read == written and [e.t for e in read] == [float(t) for t in range(100, 110)]
    assert path.read_text().splitlines()[0].startswith('{"ev":"register"')
    reg = Registry(ClusterShape(1, 4))
    assert ev.replay(path, reg) == 10
    p = reg.pipelines["A"]
    assert p.admitted and p.active == {1} and p.held == {}
    assert p.remaining() == 54 and p.requests == {}  # requests are not replayed
    ev.Journal(path).record(
        ev.Granted(pipeline="A", cluster="actor_train", priority="OLD_LOG_PROBS", devices=[0])
    )
    reg2 = Registry(ClusterShape(1, 4))
    ev.replay(path, reg2)
    assert reg2.pipelines["A"].held == {"actor_train": Priority.OLD_LOG_PROBS}


def test_a_journal_of_the_previous_version_replays(tmp_path: Path) -> None:
    """Lines as the untyped writer wrote them; only its string versions are skipped."""
    path = tmp_path / "old.jsonl"
    path.write_text(
        '{"t":1.0,"ev":"register","pipeline":"A","clusters":{"actor_train":{"tp":1,"devices":[0]},'
        '"actor_infer":{"tp":1,"devices":[0,1]}}}\n'
        '{"t":2.0,"ev":"admit","pipeline":"A"}\n'
        '{"t":3.0,"ev":"grant","pipeline":"A","cluster":"actor_train","priority":"ACTOR_TRAINING",'
        '"devices":[0]}\n'
        '{"t":4.0,"ev":"synced","pipeline":"A","rank":0,"version":"s3"}\n'
        '{"t":5.0,"ev":"expand","pipeline":"A","cluster":"actor_infer","ranks":[1],"devices":[1]}\n'
    )
    reg = Registry(ClusterShape(1, 2))
    assert ev.replay(path, reg) == 4
    assert reg.pipelines["A"].held == {"actor_train": Priority.ACTOR_TRAINING}
    assert reg.pipelines["A"].active == {1}
    # written before clusters had pp and ep: they read as the sizes of 1 they meant
    train = reg.pipelines["A"].clusters["actor_train"]
    assert (train.tp, train.pp, train.ep) == (1, 1, 1)


@pytest.mark.parametrize(
    ("junk", "cut"),
    [
        (b'{"t":9.0,"ev":"grant","pipeline":"A","clus', True),  # torn by a crash mid-write
        (b"\xff\xfe not utf-8\n", True),
        (b'{"t":9.0,"ev":"admit","pipeline":"\xff"}\n', True),  # UnicodeDecodeError inside
        (b"\x00" * 4096, True),  # a block a power loss left zeroed
        (b"[1, 2]\n", True),
        (b'"str"\n', True),
        (b'{"t":9.0,"ev":"grant","pipeline":"A"}{"t":9.1,"ev":"admit","pipeline":"A"}\n', True),
        (b'{"t":9.0,"ev":"teleport","pipeline":"A"}\n', False),  # a newer version's event
    ],
)
def test_unreadable_lines_are_skipped_and_cut_off_the_end(
    tmp_path: Path, junk: bytes, cut: bool
) -> None:
    """Read, they are skipped; opened for appending, a tail that is not whole JSON objects
    is cut off (one of another version is kept), and the next event reads back."""
    path = tmp_path / "j.jsonl"
    written = _run(path)
    with path.open("ab") as fh:
        fh.write(junk)
    assert list(ev.read_journal(path)) == written
    reg = Registry(ClusterShape(1, 4))
    journal, stats = ev.open_journal(path, reg, clock=lambda: 200.0)
    assert stats.events == 10 and stats.cut_bytes == (len(junk) if cut else 0)
    assert reg.pipelines["A"].active == {1}
    after = ev.Admitted(pipeline="A")
    journal.record(after)
    journal.close()
    assert list(ev.read_journal(path)) == [*written, after]


def test_the_timeline_reads_the_same_events(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    _run(path)
    drawn = {(s.device, s.pipeline, s.stage, s.start, s.end) for s in spans(ev.read_journal(path))}
    assert (0, "A", "ACTOR_TRAINING", 104.0, 109.0) in drawn
    assert (2, "A", "GENERATION", 103.0, 108.0) in drawn
    assert (1, "A", "GENERATION", 103.0, 109.0) in drawn  # still awake at the end


def test_the_simulator_writes_typed_events(tmp_path: Path) -> None:
    from rlix_async.config import convert
    from rlix_async.config.scenario import Scenario
    from rlix_async.sim.engine import Simulation

    sc = convert(
        {
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "pipelines": [
                {
                    "id": "s",
                    "steps": 2,
                    "step_target": 2,
                    "rollout": {"dist": "fixed", "median_s": 1},
                    "stages": {"ACTOR_TRAINING": 1},
                    "clusters": {
                        "actor_train": {"devices": [0]},
                        "actor_infer": {"devices": [0, 1]},
                    },
                }
            ],
        },
        Scenario,
        "s",
    )
    sim = Simulation(sc)
    sim.run()
    sim.write_journal(tmp_path / "sim.jsonl")
    kinds = {type(e) for e in ev.read_journal(tmp_path / "sim.jsonl")}
    assert {ev.Granted, ev.Released, ev.Expanded, ev.Shrunk} <= kinds


def test_fences_are_replayed_even_after_their_pipeline_is_gone(tmp_path: Path) -> None:
    """A restarted coordinator must not hand out devices a worker may still hold."""
    path = tmp_path / "j.jsonl"
    topo = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0, 1))}
    ev.write_journal(
        path,
        [
            ev.Registered(pipeline="p", clusters=topo),
            ev.Expanded(pipeline="p", cluster="actor_infer", ranks=[0, 1], devices=[0, 1]),
            ev.Shrunk(pipeline="p", cluster="actor_infer", ranks=[0, 1], devices=[0, 1]),
            ev.Fenced(pipeline="p", rank=0, devices=[0], holder="h:1", reason="sleeping"),
            ev.Fenced(pipeline="p", rank=1, devices=[1], holder="h:2", reason="sleeping"),
            ev.Unfenced(pipeline="p", rank=1),
            ev.Unregistered(pipeline="p", reason="lease expired"),
        ],
    )
    reg = Registry(ClusterShape(1, 2))
    ev.replay(path, reg)
    assert "p" not in reg.pipelines
    assert sorted(reg.fences) == [("p", 0)] and reg.fences[("p", 0)].holder == "h:1"
    assert reg.snapshot().fenced == [0]


def test_after_a_restart_a_rank_that_had_a_worker_is_not_taken_for_one_that_never_did(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.jsonl"
    topo = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0, 1))}
    ev.write_journal(
        path,
        [
            ev.Registered(pipeline="ft-0", clusters=topo),
            ev.ShardJoined(pipeline="ft-0", rank=0, incarnation="h:1"),
            ev.Expanded(pipeline="ft-0", cluster="actor_infer", ranks=[0], devices=[0]),
            ev.Unregistered(pipeline="ft-0", reason="lease expired"),
            ev.Fenced(pipeline="ft-0", rank=0, devices=[0], holder="h:1", reason="dropped"),
        ],
    )
    reg = Registry(ClusterShape(1, 2))
    ev.replay(path, reg)
    assert reg.workers == {("ft-0", 0): "h:1"}
    assert reg.confirm_asleep("ft-0", 0, None) is None  # its worker may be reconnecting
    assert reg.allocate_id("ft") == "ft-1"  # never the id whose worker may live on
    assert reg.worker_joined("ft-0", 0, "h:1") is None  # the same process: it must confirm
    assert reg.confirm_asleep("ft-0", 0, "h:1") is not None


# --- damage, write failures, fsync, compaction (docs/JOURNAL.md) ---------------------------

SHAPE = ClusterShape(1, 4)
TWO = {
    "A": {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
    "B": {"actor_train": ClusterSpec(1, (2, 3)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
}
BASE: list[ev.Event] = [
    ev.Registered(pipeline="A", clusters=TWO["A"]),
    ev.Admitted(pipeline="A"),
    ev.Granted(pipeline="A", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0, 1]),
    ev.Registered(pipeline="B", clusters=TWO["B"]),
    ev.Expanded(pipeline="B", cluster="actor_infer", ranks=[2, 3], devices=[2, 3]),
    ev.ShardJoined(pipeline="B", rank=1, incarnation="h:1"),
    ev.Fenced(pipeline="B", rank=1, devices=[1], holder=None, reason="sleeping"),
    ev.ProgressReported(pipeline="B", stream="default", target=64, completed=10),
]


def _base_registry() -> Registry:
    reg = Registry(SHAPE)
    ev.replay_events(BASE, reg)
    return reg


def _leases(reg: Registry) -> tuple[object, ...]:
    return (
        {pid: (p.admitted, dict(p.held), sorted(p.active)) for pid, p in reg.pipelines.items()},
        {k: (f.devices, f.holder, f.reason) for k, f in reg.fences.items()},
        dict(reg.workers),
        {pid: p.remaining() for pid, p in reg.pipelines.items()},
    )


def test_the_base_history_replays_whole() -> None:
    """(What the tests below compare with: every event of BASE applies.)"""
    reg = Registry(SHAPE)
    assert ev.replay_events(BASE, reg).skipped == 0
    assert reg.pipelines["A"].held == {"actor_train": Priority.ACTOR_TRAINING}
    assert reg.pipelines["B"].active == {2, 3} and reg.fences[("B", 1)].holder == "h:1"


@pytest.mark.parametrize(
    "stale",
    [
        ev.Granted(pipeline="A", cluster="critic", priority="CRITIC_TRAINING", devices=[0]),
        ev.Granted(pipeline="nobody", cluster="actor_train", priority="INITIALIZATION", devices=[]),
        # devices 2, 3 are B's awake ranks: the release or shrink before it was lost
        ev.Granted(pipeline="A", cluster="actor_infer", priority="GENERATION", devices=[0, 1, 2]),
        ev.Expanded(pipeline="A", cluster="actor_infer", ranks=[2], devices=[2]),  # B's rank
        ev.Expanded(pipeline="B", cluster="actor_infer", ranks=[4], devices=[]),  # no rank 4
        ev.Expanded(pipeline="B", cluster="actor_train", ranks=[0], devices=[2]),
        ev.Registered(pipeline="A", clusters=TWO["B"]),  # registered again, other topology
        ev.Registered(pipeline="C", clusters={"actor_infer": ClusterSpec(1, (4, 5))}),
        ev.Admitted(pipeline="nobody"),
        ev.Released(pipeline="nobody", cluster="actor_train"),
        ev.ProgressReported(pipeline="nobody", stream="default", target=1, completed=0),
        ev.Fenced(pipeline="B", rank=0, devices=[7], holder=None, reason="sleeping"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_event_that_no_longer_applies_is_reported_and_skipped(
    stale: ev.Event, caplog: pytest.LogCaptureFixture
) -> None:
    reg = Registry(SHAPE)
    stats = ev.replay_events([*BASE, stale, ev.Admitted(pipeline="B")], reg)
    assert stats.events == len(BASE) + 2 and stats.skipped == 1
    expected = _base_registry()
    expected.admit("B")  # the event after the skipped one still applies
    assert _leases(reg) == _leases(expected)
    assert f"journal event {len(BASE) + 1} ({type(stale).__name__} of" in caplog.text


def test_an_event_whose_replay_fails_for_any_reason_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(self: ev.Released, registry: Registry) -> None:
        raise RuntimeError("a bug in apply")

    monkeypatch.setattr(ev.Released, "apply", broken)
    path = tmp_path / "j.jsonl"
    ev.write_journal(path, [*BASE, ev.Released(pipeline="A", cluster="actor_train")])
    reg = Registry(SHAPE)
    assert ev.replay(path, reg) == len(BASE) + 1
    assert _leases(reg) == _leases(_base_registry())


def test_garbage_lines_in_the_middle_are_skipped_without_flooding_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "j.jsonl"
    ev.write_journal(path, BASE[:4])
    with path.open("ab") as fh:
        fh.write(b"\x00\xff[1]\n" * 50)
    with path.open("ab") as fh:
        fh.write(b"".join(ev._encoder.encode(e) + b"\n" for e in BASE[4:]))
    assert list(ev.read_journal(path)) == BASE
    unreadable = [r for r in caplog.records if "unreadable" in r.message]
    assert len(unreadable) == ev.MAX_WARNINGS + 1 and "50 unreadable" in unreadable[-1].message
    reg = Registry(SHAPE)
    journal, stats = ev.open_journal(path, reg)
    journal.close()
    assert stats.unreadable == 50 and stats.cut_bytes == 0
    assert _leases(reg) == _leases(_base_registry())


def test_a_torn_tail_is_cut_once_with_one_warning_and_kept_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "j.jsonl"
    ev.write_journal(path, BASE)
    whole = path.read_bytes()
    torn = b'{"ev":"grant","pipeline":"B","t":9.0,"clus\xe2\x98'  # cut mid-character
    path.write_bytes(whole + torn + b"\x00" * 100)
    journal = ev.Journal(path, clock=lambda: 0.0)
    assert journal.cut_bytes == len(torn) + 100
    assert path.read_bytes() == whole
    assert (tmp_path / "j.jsonl.cut").read_bytes() == torn + b"\x00" * 100
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert f"cut off {len(torn) + 100} bytes" in caplog.text
    journal.record(ev.Admitted(pipeline="B"))
    journal.close()
    assert list(ev.read_journal(path)) == [*BASE, ev.Admitted(pipeline="B")]


def test_a_last_event_missing_only_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    ev.write_journal(path, BASE)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    journal = ev.Journal(path, clock=lambda: 0.0)
    assert journal.cut_bytes == 0
    journal.record(ev.Admitted(pipeline="B"))
    journal.close()
    assert list(ev.read_journal(path)) == [*BASE, ev.Admitted(pipeline="B")]


def test_a_journal_of_nothing_but_garbage_is_emptied_and_then_used(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_bytes(b"\xff" * 70_000 + b"\n" + b"[1,2]\n" + b"\x00" * 70_000)  # > one block
    reg = Registry(SHAPE)
    journal, stats = ev.open_journal(path, reg, clock=lambda: 0.0)
    assert stats.cut_bytes == 140_007 and stats.events == 0 and reg.pipelines == {}
    journal.record(BASE[0])
    journal.close()
    assert list(ev.read_journal(path)) == [BASE[0]]


# --- write failures --------------------------------------------------------------------------


def test_a_full_disk_raises_journal_write_error() -> None:
    journal = ev.Journal("/dev/full", clock=lambda: 0.0)  # every write: ENOSPC
    with pytest.raises(ev.JournalWriteError) as info:
        journal.record(BASE[2])
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    journal.close()


def test_recording_on_a_closed_journal_raises(tmp_path: Path) -> None:
    journal = ev.Journal(tmp_path / "j.jsonl", clock=lambda: 0.0)
    journal.close()
    with pytest.raises(ev.JournalWriteError, match="closed"):
        journal.record(BASE[0])
    ev.Journal(None, clock=lambda: 0.0).record(BASE[0])  # no journal configured: nothing to fail


def test_a_write_that_fails_half_way_leaves_no_fragment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    journal = ev.Journal(path, clock=lambda: 0.0, fsync="never")
    journal.record(BASE[0])
    before = path.read_bytes()
    real_write = os.write
    calls: list[int] = []

    def half_then_full(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ev.os, "write", half_then_full)
    with pytest.raises(ev.JournalWriteError, match="not recorded"):
        journal.record(BASE[2])
    monkeypatch.undo()
    assert path.read_bytes() == before  # the half line was truncated away
    journal.record(BASE[1])
    journal.close()
    assert list(ev.read_journal(path)) == BASE[:2]


def test_a_failed_fsync_raises_journal_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = ev.Journal(tmp_path / "j.jsonl", clock=lambda: 0.0)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ev.os, "fsync", eio)
    with pytest.raises(ev.JournalWriteError) as info:
        journal.record(BASE[2])
    assert info.value.errno == errno.EIO
    journal.close()


# --- fsync policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "alone", "in_batch"),
    [("leases", 1, 1), ("always", 2, 1), ("never", 0, 0)],
)
def test_fsync_policy(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    policy: ev.FsyncPolicy,
    alone: int,
    in_batch: int,
) -> None:
    """'leases': a grant is on disk before record returns, a progress report is not;
    a batch (a plan's events) costs one fsync."""
    journal = ev.Journal(tmp_path / "j.jsonl", clock=lambda: 0.0, fsync=policy)
    syncs: list[int] = []
    monkeypatch.setattr(ev.os, "fsync", syncs.append)
    journal.record(BASE[7])  # progress
    journal.record(BASE[2])  # grant
    assert len(syncs) == alone
    syncs.clear()
    with journal.batch():
        journal.record(BASE[4])
        journal.record(BASE[6])
        journal.record(BASE[7])
        assert syncs == []
    assert len(syncs) == in_batch
    journal.close()


# --- compaction -------------------------------------------------------------------------------


def test_compaction_rewrites_a_long_journal_as_one_snapshot_that_replays_the_same(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.jsonl"
    history = [*BASE, ev.Shrunk(pipeline="B", cluster="actor_infer", ranks=[3], devices=[3])]
    ev.write_journal(path, history)
    inode = path.stat().st_ino
    reg = Registry(SHAPE)
    journal, stats = ev.open_journal(path, reg, compact_over=len(history) - 1)
    assert stats.compacted and stats.events == len(history)
    [snapshot] = ev.read_journal(path)
    assert isinstance(snapshot, ev.RegistrySnapshot) and snapshot.t > 0
    assert path.stat().st_ino != inode  # renamed over, not rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == ["j.jsonl"]  # no temporary left
    full = Registry(SHAPE)
    ev.replay_events(history, full)
    assert _leases(reg) == _leases(full)
    journal.clock = lambda: 0.0
    journal.record(ev.Released(pipeline="A", cluster="actor_train"))  # after the snapshot
    journal.close()
    again = Registry(SHAPE)
    journal, stats = ev.open_journal(path, again, compact_over=len(history) - 1)
    journal.close()
    assert stats.events == 2 and not stats.compacted
    ev.replay_events([ev.Released(pipeline="A", cluster="actor_train")], full)
    assert _leases(again) == _leases(full) and again.pipelines["A"].held == {}


def test_a_snapshot_keeps_a_fence_holder_as_it_was() -> None:
    """Fenced before its rank's worker said hello: no holder, though the rank has a
    worker now (only a sleep the unknown holder confirms, or a replacement, lifts it)."""
    history: list[ev.Event] = [
        ev.Fenced(pipeline="gone", rank=0, devices=[0], holder=None, reason="dropped"),
        ev.ShardJoined(pipeline="gone", rank=0, incarnation="h:7"),
    ]
    full = Registry(SHAPE)
    ev.replay_events(history, full)
    restored = Registry(SHAPE)
    ev.replay_events([ev.RegistrySnapshot.of(full)], restored)
    assert full.fences[("gone", 0)].holder is None
    assert _leases(restored) == _leases(full)


def test_a_running_journal_compacts_once_it_grows_past_the_threshold(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    reg = Registry(SHAPE)
    journal, _ = ev.open_journal(path, reg, clock=lambda: 0.0)
    for e in BASE:  # as a coordinator does: change the registry, record the change
        e.apply(reg)
        journal.record(e)
    assert not journal.maybe_compact(reg, over=len(BASE))
    journal.record(ev.Released(pipeline="A", cluster="actor_train"))
    reg.release("A", "actor_train")
    assert journal.maybe_compact(reg, over=len(BASE))
    journal.record(ev.Admitted(pipeline="B"))
    reg.admit("B")
    journal.close()
    assert [type(e) for e in ev.read_journal(path)] == [ev.RegistrySnapshot, ev.Admitted]
    again = Registry(SHAPE)
    ev.replay(path, again)
    assert _leases(again) == _leases(reg)


def test_a_journal_under_the_threshold_is_not_compacted(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    ev.write_journal(path, BASE)
    journal, stats = ev.open_journal(path, Registry(SHAPE), compact_over=len(BASE))
    journal.close()
    assert not stats.compacted and list(ev.read_journal(path)) == BASE


def test_a_compaction_that_fails_leaves_the_journal_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    ev.write_journal(path, BASE)
    before = path.read_bytes()
    (tmp_path / ".j.jsonl.compacting").mkdir()  # the temporary file cannot be created
    reg = Registry(SHAPE)
    journal, stats = ev.open_journal(path, reg, clock=lambda: 0.0, compact_over=1)
    assert not stats.compacted and path.read_bytes() == before
    journal.record(ev.Admitted(pipeline="B"))  # still appending to the same file
    journal.close()
    assert list(ev.read_journal(path))[: len(BASE)] == BASE
    assert len(list(ev.read_journal(path))) == len(BASE) + 1


def test_a_snapshot_replaces_what_the_registry_held_and_survives_a_smaller_cluster() -> None:
    snapshot = ev.RegistrySnapshot.of(_base_registry())
    reg = Registry(SHAPE)
    ev.replay_events([ev.Registered(pipeline="old", clusters=TWO["A"]), snapshot], reg)
    assert sorted(reg.pipelines) == ["A", "B"]  # "old" was not in the snapshot
    small = Registry(ClusterShape(1, 2))  # B's awake ranks 2, 3 no longer exist
    ev.replay_events([snapshot], small)
    assert small.pipelines == {}  # neither topology fits two devices
    assert small.fences[("B", 1)].devices == (1,)  # what still applies is restored
    assert small.workers == {("B", 1): "h:1"}


def test_the_timeline_passes_over_a_snapshot(tmp_path: Path) -> None:
    """A compacted journal starts with a snapshot: drawn from the events after it."""
    path = tmp_path / "j.jsonl"
    _run(path)
    later = list(ev.read_journal(path))
    snapshot = ev.RegistrySnapshot.of(_base_registry())
    snapshot.t = 99.0  # compacted just before the events that follow
    assert spans([snapshot, *later]) == spans(later) != []


def test_a_pipelines_weight_survives_replay_and_compaction(tmp_path: Path) -> None:
    """A weight lost in compaction would silently give a pipeline the default share
    after the coordinator's next restart (compaction runs on a live coordinator)."""
    path = tmp_path / "j.jsonl"
    history = [ev.Registered(pipeline="A", clusters=TWO["A"], weight=2.5), *BASE[1:]]
    ev.write_journal(path, history)
    reg = Registry(SHAPE)
    journal, stats = ev.open_journal(path, reg, compact_over=1)
    journal.close()
    assert stats.compacted and reg.pipelines["A"].weight == 2.5
    [snapshot] = ev.read_journal(path)
    again = Registry(SHAPE)
    ev.replay_events([snapshot], again)
    assert again.pipelines["A"].weight == 2.5 and again.pipelines["B"].weight == 1.0
