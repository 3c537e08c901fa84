"""The journal survives anything, as properties over random histories (docs/JOURNAL.md).

A journal is built from a random event sequence, then damaged: cut at a random offset
(a crash mid-write tears the last line, a multi-byte character included) and/or
followed by random bytes (invalid UTF-8, NUL runs a power loss leaves, lines that are
JSON but not objects). Opening it must keep exactly the events whose lines were whole,
replay them to the registry the undamaged prefix gives, cut the rest, and let the next
event be read back intact. Garbage between whole events loses nothing. A snapshot
followed by later events replays to what the whole history replays to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_async.control import journal as ev
from rlix_async.control.registry import Registry
from rlix_async.protocols.topology import INFER, TRAIN, ClusterShape, ClusterSpec

SHAPE = ClusterShape(1, 4)
PIPES = {
    "a": {TRAIN: ClusterSpec(1, (0, 1)), INFER: ClusterSpec(1, (0, 1, 2, 3))},
    "b": {TRAIN: ClusterSpec(1, (2, 3)), INFER: ClusterSpec(2, (0, 1, 2, 3))},
    # a topology the 4-device cluster refuses: its Registered is skipped on replay
    "z": {INFER: ClusterSpec(1, (4, 5))},
}
PRIORITIES = ["INITIALIZATION", "ACTOR_TRAINING", "OLD_LOG_PROBS", "GENERATION"]

pids = st.sampled_from(["a", "b", "b", "z", "gone"])
clusters = st.sampled_from([TRAIN, INFER, "critic"])
ranks = st.lists(st.integers(0, 4), max_size=3, unique=True)
devices = st.lists(st.integers(0, 5), max_size=3, unique=True)
# multi-byte characters: a cut inside one leaves invalid UTF-8
text = st.text(alphabet="ab é☃😀", max_size=6)
holders = st.none() | st.sampled_from(["h:1", "h:2"])

events = st.one_of(
    st.builds(lambda p: ev.Registered(pipeline=p, clusters=PIPES.get(p, PIPES["a"])), pids),
    st.builds(ev.Admitted, pipeline=pids),
    st.builds(ev.Unregistered, pipeline=pids, reason=text),
    st.builds(
        ev.Requested,
        pipeline=pids,
        cluster=clusters,
        priority=st.sampled_from(PRIORITIES),
        seq=st.integers(0, 9),
    ),
    st.builds(
        ev.Granted,
        pipeline=pids,
        cluster=clusters,
        priority=st.sampled_from(PRIORITIES),
        devices=devices,
    ),
    st.builds(ev.Released, pipeline=pids, cluster=clusters),
    st.builds(ev.Expanded, pipeline=pids, cluster=st.just(INFER), ranks=ranks, devices=devices),
    st.builds(ev.Shrunk, pipeline=pids, cluster=st.just(INFER), ranks=ranks, devices=devices),
    st.builds(
        ev.Fenced,
        pipeline=pids,
        rank=st.integers(0, 3),
        devices=devices,
        holder=holders,
        reason=text,
    ),
    st.builds(ev.Unfenced, pipeline=pids, rank=st.integers(0, 3), reason=text),
    st.builds(ev.ShardJoined, pipeline=pids, rank=st.integers(0, 3), incarnation=st.just("h:2")),
    st.builds(
        ev.ProgressReported,
        pipeline=pids,
        stream=st.sampled_from(["default", "é"]),
        target=st.integers(0, 99),
        completed=st.integers(0, 99),
    ),
    st.builds(ev.ProgressCleared, pipeline=pids, stream=st.none() | st.just("é")),
    st.builds(ev.WeightsPublished, pipeline=pids, version=st.integers(0, 9)),
    st.builds(ev.ShardSynced, pipeline=pids, rank=st.integers(0, 3), version=st.none()),
)
# Registrations first, so that most later events apply (the rest are skipped on replay).
histories = st.lists(events, max_size=30).map(
    lambda evs: [
        ev.Registered(pipeline="a", clusters=PIPES["a"]),
        ev.Admitted(pipeline="a"),
        ev.Registered(pipeline="b", clusters=PIPES["b"]),
        *evs,
    ]
)

# Garbage never holds a brace outside whole lines that are JSON arrays: no torn line it
# follows and no line of its own can become a JSON object (which would be kept).
random_bytes = st.binary(max_size=40).map(lambda b: b.replace(b"{", b"?").replace(b"}", b"?"))
junk_pieces = st.one_of(
    random_bytes,
    st.sampled_from(
        [
            b"\xff\xfe\xfa",  # invalid UTF-8
            b"\xc3",  # a multi-byte character cut short
            b"\x00" * 512,  # blocks a power loss left zeroed
            b"[1,2]\n",
            b'"str"\n',
            b"null\n42\n",
            b"\n",
            b" \t\r",
            b'\n[{"ev":"admit","pipeline":"a"}]\n',  # an event, but not an object line
        ]
    ),
)
junk = st.lists(junk_pieces, max_size=4).map(b"".join)


def state(reg: Registry) -> tuple[Any, ...]:
    """What replay rebuilds, read straight off the registry."""
    return (
        {
            pid: (
                p.clusters,
                p.admitted,
                dict(p.held),
                sorted(p.active),
                {s: (pr.target, pr.completed) for s, pr in p.progress.items()},
            )
            for pid, p in reg.pipelines.items()
        },
        {k: (f.devices, f.holder, f.reason) for k, f in reg.fences.items()},
        dict(reg.workers),
    )


def replayed(events: list[ev.Event]) -> Registry:
    reg = Registry(SHAPE)
    ev.replay_events(events, reg)
    return reg


def write(path: Path, history: list[ev.Event]) -> tuple[bytes, list[int]]:
    """The journal's bytes, and where each event's line ends (after its newline)."""
    clock = iter(range(1, 10_000))
    j = ev.Journal(path, clock=lambda: float(next(clock)), fsync="never")
    ends = []
    for e in history:
        j.record(e)
        ends.append(path.stat().st_size)
    j.close()
    return path.read_bytes(), ends


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(history=histories, cut_at=st.floats(0, 1), tail=junk, data=st.data())
def test_a_damaged_tail_keeps_every_whole_event_and_the_next_append_reads_back(
    history: list[ev.Event], cut_at: float, tail: bytes, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j.jsonl"
        clean, ends = write(path, history)
        cut = int(cut_at * len(clean))
        if data.draw(st.booleans(), "cut exactly at a line's end or just before its newline"):
            cut = data.draw(st.sampled_from(ends)) - data.draw(st.sampled_from([0, 1]))
        damaged = clean[:cut] + tail
        path.write_bytes(damaged)

        # Whole lines are kept; so is one cut just before its newline when nothing but
        # blanks follows it on its line (it is a whole event, the newline is added).
        first_line = tail.split(b"\n", 1)[0]
        kept = [
            e
            for e, end in zip(history, ends, strict=True)
            if end <= cut or (end - 1 == cut and not first_line.strip(b" \t\r"))
        ]
        assert list(ev.read_journal(path)) == kept  # reading alone never raises

        reg = Registry(SHAPE)
        journal, stats = ev.open_journal(path, reg, fsync="never")
        assert state(reg) == state(replayed(kept))
        assert stats.events == len(kept)
        repaired = path.read_bytes()
        assert repaired.endswith(b"\n") or repaired == b""
        # the damaged file up to its last whole event, ended by a newline if it lacked one
        n = len(repaired) if damaged.startswith(repaired) else len(repaired) - 1
        assert repaired == damaged[:n] + b"\n" * (len(repaired) - n)
        assert stats.cut_bytes == len(damaged) - n
        assert list(ev.read_journal(path)) == kept

        after = ev.Granted(pipeline="a", cluster=TRAIN, priority="ACTOR_TRAINING", devices=[0])
        journal.record(after)
        journal.close()
        assert list(ev.read_journal(path)) == [*kept, after]
        again, stats = ev.open_journal(path, Registry(SHAPE), fsync="never")
        again.close()
        assert stats.cut_bytes == 0 and stats.unreadable == 0


@PROPERTY
@given(history=histories, where=st.floats(0, 1, exclude_max=True), garbage=junk)
def test_garbage_between_whole_events_loses_none_of_them(
    history: list[ev.Event], where: float, garbage: bytes
) -> None:
    """Bytes a disk mangled in the middle are skipped line by line; the events after them
    are read and replayed, and nothing after the garbage is cut."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j.jsonl"
        clean, ends = write(path, history)
        at = ([0, *ends])[int(where * len(ends))]  # a line boundary before the last event
        path.write_bytes(clean[:at] + b"\n" + garbage + b"\n" + clean[at:])
        reg = Registry(SHAPE)
        journal, stats = ev.open_journal(path, reg, fsync="never")
        journal.close()
        assert stats.cut_bytes == 0 and stats.events == len(history)
        assert list(ev.read_journal(path)) == history
        assert state(reg) == state(replayed(history))


@PROPERTY
@given(history=histories, later=st.lists(events, max_size=15))
def test_a_snapshot_and_later_events_replay_like_the_whole_history(
    history: list[ev.Event], later: list[ev.Event]
) -> None:
    snapshot = ev.RegistrySnapshot.of(replayed(history))
    # as it is read back from a file
    decoded = msgspec.json.decode(msgspec.json.encode(snapshot), type=ev.Event)
    assert isinstance(decoded, ev.RegistrySnapshot)
    assert state(replayed([decoded, *later])) == state(replayed([*history, *later]))
