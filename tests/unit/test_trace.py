"""``rlix-async trace``: journals as Chrome trace JSON (observe/trace.py), checked against
the Trace Event Format's rules (``trace_problems``, itself tested on broken traces), on
a hand-built coordinator journal with every event type and on a simulator's journal."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rlix_async.config import Scenario, load_config
from rlix_async.control import journal as ev
from rlix_async.observe.timeline import spans
from rlix_async.observe.trace import (
    DEVICES_PID,
    PIPELINES_PID,
    build_trace,
    trace_problems,
    write_trace,
)
from rlix_async.protocols.topology import ClusterSpec
from rlix_async.sim.policies import simulate

SCENARIOS = Path(__file__).parents[2] / "scenarios"


def _of(trace: dict[str, Any], ph: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        e for e in trace["traceEvents"] if e["ph"] == ph and (name is None or e["name"] == name)
    ]


def _thread_names(trace: dict[str, Any], pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in _of(trace, "M", "thread_name") if e["pid"] == pid}


def test_a_grant_then_release_is_one_slice_on_each_device() -> None:
    trace = build_trace(
        [
            ev.Granted(
                pipeline="A",
                cluster="actor_train",
                priority="ACTOR_TRAINING",
                devices=[0, 2],
                t=100.0,
            ),
            ev.Released(pipeline="A", cluster="actor_train", t=102.5),
        ]
    )
    assert trace_problems(trace) == []
    slices = _of(trace, "X")
    assert sorted((s["tid"], s["ts"], s["dur"], s["name"]) for s in slices) == [
        (1, 0, 2_500_000, "A train"),
        (3, 0, 2_500_000, "A train"),
    ]
    assert all(s["pid"] == DEVICES_PID and s["args"]["cluster"] == "actor_train" for s in slices)
    assert _thread_names(trace, DEVICES_PID) == {1: "dev 0", 3: "dev 2"}
    assert trace["displayTimeUnit"] == "ms"


COORDINATOR_JOURNAL = [  # what a coordinator writes, one of each event, t in unix seconds
    ev.Registered(
        pipeline="A",
        clusters={
            "actor_train": ClusterSpec(1, (0, 1)),
            "actor_infer": ClusterSpec(2, (0, 1, 2, 3)),
        },
        t=1000.0,
    ),
    ev.Admitted(pipeline="A", t=1000.5),
    ev.ProgressReported(pipeline="A", stream="main", target=64, completed=16, t=1001.0),
    ev.Requested(pipeline="A", cluster="actor_infer", priority="GENERATION", seq=1, t=1001.0),
    ev.Expanded(pipeline="A", cluster="actor_infer", ranks=[0, 1], devices=[0, 1, 2, 3], t=1002.0),
    ev.ShardJoined(pipeline="A", rank=1, incarnation="w1", t=1002.1),
    ev.WeightsPublished(pipeline="A", version=3, t=1003.0),
    ev.ShardSynced(pipeline="A", rank=1, version=3, t=1003.5),
    ev.Requested(pipeline="A", cluster="actor_train", priority="ACTOR_TRAINING", seq=2, t=1004.0),
    ev.Shrunk(pipeline="A", cluster="actor_infer", ranks=[0], devices=[0, 1], t=1005.0),
    ev.Fenced(
        pipeline="A", rank=0, devices=[0, 1], holder="A/infer/0", reason="sleeping", t=1005.0
    ),
    ev.Granted(
        pipeline="A", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0, 1], t=1005.0
    ),
    ev.Unfenced(pipeline="A", rank=0, t=1005.4),
    ev.ProgressCleared(pipeline="A", stream="main", t=1006.0),
    ev.Released(pipeline="A", cluster="actor_train", t=1007.0),
    ev.Unregistered(pipeline="A", reason="finished", t=1008.0),
]


def test_a_coordinators_journal_every_event_type(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    ev.write_journal(journal, COORDINATOR_JOURNAL)
    with journal.open("ab") as fh:  # a compaction snapshot and an event of a newer version:
        fh.write(b'{"ev":"snapshot","pipeline":"","t":0.0}\n')  # passed over, and their
        fh.write(b'{"ev":"from_the_future","pipeline":"A","t":1.0}\n')  # times set no origin
    out = write_trace(journal, tmp_path / "trace.json")
    trace = json.loads(out.read_text())
    assert trace_problems(trace) == []
    assert trace["otherData"]["t0_s"] == "1000.0"
    us = lambda t: round((t - 1000.0) * 1e6)  # noqa: E731

    # rank 1 of a tp=2 cluster is devices 2, 3 (its registered topology)
    rollout = sorted(
        (s["tid"] - 1, s["args"].get("rank"), s["ts"], s["dur"])
        for s in _of(trace, "X", "A rollout")
    )
    assert rollout == [
        (0, 0, us(1002.0), us(1005.0) - us(1002.0)),
        (1, 0, us(1002.0), us(1005.0) - us(1002.0)),
        (2, 1, us(1002.0), us(1008.0) - us(1002.0)),  # until the pipeline left
        (3, 1, us(1002.0), us(1008.0) - us(1002.0)),
    ]
    train = sorted((s["tid"] - 1, s["ts"], s["dur"]) for s in _of(trace, "X", "A train"))
    assert train == [
        (0, us(1005.0), us(1007.0) - us(1005.0)),
        (1, us(1005.0), us(1007.0) - us(1005.0)),
    ]

    def instants(name: str) -> list[tuple[int, int, int]]:
        return sorted((e["pid"], e["tid"], e["ts"]) for e in _of(trace, "i", name))

    assert instants("A sync v3") == [(DEVICES_PID, 3, us(1003.5)), (DEVICES_PID, 4, us(1003.5))]
    assert instants("A shrink") == [(DEVICES_PID, 1, us(1005.0)), (DEVICES_PID, 2, us(1005.0))]
    assert instants("A fence") == instants("A shrink")
    assert instants("A unfence") == [(DEVICES_PID, 1, us(1005.4)), (DEVICES_PID, 2, us(1005.4))]
    assert all(e["s"] == "t" for e in _of(trace, "i"))
    assert [e["cat"] for e in _of(trace, "i", "A shrink")] == ["preemption", "preemption"]
    tid_a = {v: k for k, v in _thread_names(trace, PIPELINES_PID).items()}["A"]
    for name, t in (
        ("register", 1000.0),
        ("admit", 1000.5),
        ("publish v3", 1003.0),
        ("unregister", 1008.0),
    ):
        assert instants(name) == [(PIPELINES_PID, tid_a, us(t))], name

    def counter(name: str) -> list[tuple[int, dict[str, int]]]:
        return [(e["ts"], e["args"]) for e in _of(trace, "C", name)]

    assert counter("A devices") == [
        (us(1002.0), {"train": 0, "rollout": 4}),
        (us(1005.0), {"train": 0, "rollout": 2}),
        (us(1005.0), {"train": 2, "rollout": 2}),
        (us(1007.0), {"train": 0, "rollout": 2}),
        (us(1008.0), {"train": 0, "rollout": 0}),
    ]
    assert counter("A demand") == [  # the rollout request is not a queued gang request
        (us(1001.0), {"remaining": 48, "queued": 0}),
        (us(1004.0), {"remaining": 48, "queued": 1}),
        (us(1005.0), {"remaining": 48, "queued": 0}),
        (us(1006.0), {"remaining": 0, "queued": 0}),
    ]


def test_a_simulators_journal(tmp_path: Path) -> None:
    """Two pipelines time-sharing 8 devices with tp=2 shards: preemptions on real
    planner output; the trace's slices are exactly the timeline's spans."""
    sc = load_config(SCENARIOS / "agentic_longtail_tp2.yaml", Scenario)
    journal = tmp_path / "sim.jsonl"
    result = simulate(sc, "timeshare", journal=journal)
    assert result["preemptions"] > 0
    trace = json.loads(write_trace(journal, tmp_path / "t.json").read_text())
    assert trace_problems(trace) == []
    events = list(ev.read_journal(journal))
    expected = sorted((s.device, s.pipeline, s.start, s.end) for s in spans(events))
    t0 = min(e.t for e in events)
    got = sorted(
        (s["tid"] - 1, s["name"].split()[0], s["ts"], s["ts"] + s["dur"]) for s in _of(trace, "X")
    )
    assert got == [(d, p, round((a - t0) * 1e6), round((b - t0) * 1e6)) for d, p, a, b in expected]
    shrunk = sum(len(e.devices) for e in events if isinstance(e, ev.Shrunk))
    assert len([e for e in _of(trace, "i") if e["cat"] == "preemption"]) == shrunk > 0
    devices = {d for e in events if isinstance(e, ev.Granted | ev.Expanded) for d in e.devices}
    assert set(_thread_names(trace, DEVICES_PID)) == {d + 1 for d in devices}
    assert not _of(trace, "C", f"{events[0].pipeline} demand")  # the simulator reports none


def test_ownership_is_never_taken_from_the_wrong_holder() -> None:
    """A repeated grant continues its slice; a release closes only its own holder's
    devices (never a device another pipeline took since)."""
    grant = {"cluster": "actor_train", "priority": "ACTOR_TRAINING", "devices": [0]}
    trace = build_trace(
        [
            ev.Granted(pipeline="A", t=0.0, **grant),  # type: ignore[arg-type]
            ev.Granted(pipeline="A", t=1.0, **grant),  # type: ignore[arg-type]
            ev.Expanded(pipeline="B", cluster="actor_infer", ranks=[0], devices=[0], t=2.0),
            ev.Released(pipeline="A", cluster="actor_train", t=3.0),  # stale: B holds dev 0
            ev.Shrunk(pipeline="B", cluster="actor_infer", ranks=[0], devices=[0], t=4.0),
        ]
    )
    assert [(s["name"], s["ts"], s["dur"]) for s in _of(trace, "X")] == [
        ("A train", 0, 2_000_000),
        ("B rollout", 2_000_000, 2_000_000),
    ]


def test_a_journal_without_scheduling_events_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no scheduling events"):
        write_trace(empty, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


# --- the rules themselves: each one catches what breaks it --------------------------------

VALID: dict[str, Any] = {
    "traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "devices"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "dev 0"}},
        {"name": "outer", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"name": "inner", "ph": "X", "ts": 2, "dur": 3, "pid": 1, "tid": 1},  # nested: fine
        {"name": "next", "ph": "X", "ts": 10, "dur": 5, "pid": 1, "tid": 1},  # touching: fine
        {"name": "mark", "ph": "i", "s": "t", "ts": 4, "pid": 1, "tid": 1},
        {"name": "load", "ph": "C", "ts": 4, "pid": 1, "tid": 1, "args": {"a": 1, "b": 0.5}},
    ],
    "displayTimeUnit": "ms",
}


def _broken(index: int | None, **change: Any) -> dict[str, Any]:
    trace = copy.deepcopy(VALID)
    if index is None:
        trace.update(change)
    else:
        trace["traceEvents"][index].update(change)
        for key in [k for k, v in change.items() if v is ...]:
            del trace["traceEvents"][index][key]
    return trace


@pytest.mark.parametrize(
    ("trace", "problem"),
    [
        ({"events": []}, "traceEvents"),
        (_broken(None, displayTimeUnit="s"), "displayTimeUnit"),
        (_broken(2, dur=...), "dur"),
        (_broken(2, dur=-1), "dur"),
        (_broken(2, ts=-5), "ts"),
        (_broken(2, ts=float("nan")), "ts"),
        (_broken(5, ts=...), "ts"),
        (_broken(2, tid="1"), "pid and tid"),
        (_broken(2, pid=True), "pid and tid"),
        (_broken(2, ph="Z"), "phase"),
        (_broken(2, name=""), "no name"),
        (_broken(3, ts=8), "overlaps"),  # 8..11 sticks out of outer 0..10
        (_broken(5, s="x"), "scope"),
        (_broken(5, tid=7), "tid 7 has no name"),
        (_broken(0, pid=3), "pid 1 has no name"),
        (_broken(6, args={"a": "many"}), "counter"),
        (_broken(6, args={}), "counter"),
        (_broken(1, args={}), "metadata"),
        (_broken(1, name="thread_colour"), "metadata"),
        (_broken(6, args={"a": 1, "b": object()}), "counter"),
    ],
)
def test_each_broken_rule_is_caught(trace: dict[str, Any], problem: str) -> None:
    assert trace_problems(VALID) == []
    found = trace_problems(trace)
    assert any(problem in p for p in found), found
