"""The journal's typed events: one vocabulary for the coordinator, the replay, the
timeline and the simulator; files written by earlier versions still replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlix_async.control import journal as ev
from rlix_async.control.registry import Registry
from rlix_async.control.topology import ClusterShape, ClusterSpec, Priority
from rlix_async.observe.timeline import intervals

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


@pytest.mark.parametrize(
    "junk",
    [
        b'{"t":9.0,"ev":"grant","pipeline":"A","clus',  # torn by a crash mid-write
        b"\xff\xfe not utf-8\n",
        b'{"t":9.0,"ev":"teleport","pipeline":"A"}\n',  # an event this version does not know
        b"[1, 2]\n",
    ],
)
def test_unreadable_lines_are_skipped(tmp_path: Path, junk: bytes) -> None:
    path = tmp_path / "j.jsonl"
    _run(path)
    with path.open("ab") as fh:
        fh.write(junk)
    assert len(list(ev.read_journal(path))) == 10


def test_the_timeline_reads_the_same_events(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    _run(path)
    spans = intervals(list(ev.read_journal(path)))
    assert (0, "A", "ACTOR_TRAINING", 104.0, 109.0) in spans
    assert (2, "A", "GENERATION", 103.0, 108.0) in spans
    assert (1, "A", "GENERATION", 103.0, 109.0) in spans  # still awake at the end


def test_the_simulator_writes_typed_events(tmp_path: Path) -> None:
    from rlix_async.config import convert
    from rlix_async.config.schema import Scenario
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
    sim = Simulation(sc, plan_interval_s=0.0)
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
