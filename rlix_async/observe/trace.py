"""``rlix-async trace``: a scheduling journal as Chrome trace event JSON, for Perfetto
(ui.perfetto.dev) and chrome://tracing.

The JSON object form of the Trace Event Format: ``{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}``. What it shows:

- process 1 ``devices``, one thread per device (``dev N``, in device order): a
  complete slice (ph ``X``) for each stretch a pipeline's stage or rollout rank held
  the device, named ``<pipeline> <stage>`` (``train``, ``rollout`` or the stage's
  lower-case name; args: cluster, priority, rank); thread instants (ph ``i``) where
  a rollout rank was shrunk (``<pipeline> shrink``: a preemption, or the pipeline
  ending), fenced and unfenced, and where a shard loaded a weight version
  (``<pipeline> sync vN``).
- process 2 ``pipelines``, one thread per pipeline: instants for register, admit,
  unregister and each weight version published; and per pipeline two counters
  (ph ``C``): ``<pipeline> devices`` (``train``: devices its stages hold,
  ``rollout``: devices its awake shards hold) and, where the journal has them
  (a coordinator's; the simulator writes none), ``<pipeline> demand``
  (``remaining``: trajectories its progress reports still ask for, what sizes its
  rollout share; ``queued``: its stage requests, training and the like, waiting
  for their grant).

Times are whole microseconds since the journal's first event; ``otherData.t0_s`` is
that event's time (unix seconds in a coordinator's journal, simulated seconds in
the simulator's). Device ownership is :class:`~rlix_async.observe.timeline.Ownership`,
the one ``rlix-async timeline`` draws. Snapshot (compaction) and unknown events
are passed over.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from rlix_async.control.journal import (
    Admitted,
    Event,
    Expanded,
    Fenced,
    Granted,
    ProgressCleared,
    ProgressReported,
    Registered,
    Released,
    Requested,
    ShardSynced,
    Shrunk,
    Unfenced,
    Unregistered,
    WeightsPublished,
    read_journal,
)
from rlix_async.observe.timeline import GENERATION, Ownership, Span

DEVICES_PID = 1  # pid and tid 0 are avoided: some viewers treat 0 as "no process"
PIPELINES_PID = 2
DRAWN = (
    Registered,
    Admitted,
    Unregistered,
    Requested,
    Granted,
    Released,
    Expanded,
    Shrunk,
    Fenced,
    Unfenced,
    ProgressReported,
    ProgressCleared,
    WeightsPublished,
    ShardSynced,
)
STAGE_LABEL = {GENERATION: "rollout", "ACTOR_TRAINING": "train"}

TraceEvent = dict[str, Any]


def stage_label(stage: str) -> str:
    return STAGE_LABEL.get(stage, stage.lower())


class _Trace:
    """The events of one trace as they are built; ids for threads as they appear."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.events: list[TraceEvent] = []
        self.devices: set[int] = set()
        self.pipelines: dict[str, int] = {}  # pipeline -> its tid in PIPELINES_PID
        self.fences: dict[tuple[str, int], list[int]] = {}
        self.progress: dict[str, dict[str, tuple[int, int]]] = {}  # stream -> target, done
        self.queued: dict[str, set[str]] = {}  # clusters of gang requests not yet granted
        self.demand: dict[str, tuple[int, int]] = {}  # last emitted, per pipeline

    def us(self, t: float) -> int:
        # whole microseconds: a slice's ts + dur is exactly the next one's ts
        return max(0, round((t - self.t0) * 1e6))

    def tid(self, pipeline: str) -> int:
        return self.pipelines.setdefault(pipeline, len(self.pipelines) + 1)

    def on_devices(
        self, t: float, devices: Iterable[int], name: str, cat: str, args: dict[str, Any]
    ) -> None:
        for d in devices:
            self.devices.add(d)
            self.events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "i",
                    "s": "t",
                    "ts": self.us(t),
                    "pid": DEVICES_PID,
                    "tid": d + 1,
                    "args": args,
                }
            )

    def on_pipeline(
        self, t: float, pipeline: str, name: str, cat: str, args: dict[str, Any]
    ) -> None:
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "i",
                "s": "t",
                "ts": self.us(t),
                "pid": PIPELINES_PID,
                "tid": self.tid(pipeline),
                "args": args,
            }
        )

    def counter(self, t: float, pipeline: str, what: str, values: dict[str, int]) -> None:
        self.events.append(
            {
                "name": f"{pipeline} {what}",
                "ph": "C",
                "ts": self.us(t),
                "pid": PIPELINES_PID,
                "tid": self.tid(pipeline),
                "args": values,
            }
        )

    def slice(self, s: Span) -> None:
        self.devices.add(s.device)
        args: dict[str, Any] = {"cluster": s.cluster, "priority": s.stage}
        if s.rank is not None:
            args["rank"] = s.rank
        if s.until_end:
            args["held_at_journal_end"] = True
        start = self.us(s.start)
        self.events.append(
            {
                "name": f"{s.pipeline} {stage_label(s.stage)}",
                "cat": stage_label(s.stage),
                "ph": "X",
                "ts": start,
                "dur": self.us(s.end) - start,
                "pid": DEVICES_PID,
                "tid": s.device + 1,
                "args": args,
            }
        )

    def note_demand(self, e: Event) -> None:
        """Progress and queued requests, after ``e``; a counter where they changed."""
        pid = e.pipeline
        match e:
            case ProgressReported():
                self.progress.setdefault(pid, {})[e.stream] = (e.target, e.completed)
            case ProgressCleared():
                streams = self.progress.setdefault(pid, {})
                if e.stream is None:
                    streams.clear()
                else:
                    streams.pop(e.stream, None)
            case Requested() if e.priority != GENERATION:
                # a rollout request is answered by an awake rank, which the journal
                # does not mark; rollout demand is ``remaining``
                self.queued.setdefault(pid, set()).add(e.cluster)
            case Granted():
                self.queued.get(pid, set()).discard(e.cluster)
            case Unregistered():
                self.progress.pop(pid, None)
                self.queued.pop(pid, None)
        if pid not in self.progress and pid not in self.queued and pid not in self.demand:
            return  # a journal without demand (the simulator's) gets no demand counter
        remaining = sum(
            max(target - done, 0) for target, done in self.progress.get(pid, {}).values()
        )
        now = (remaining, len(self.queued.get(pid, ())))
        if self.demand.get(pid) != now:
            self.demand[pid] = now
            self.counter(e.t, pid, "demand", {"remaining": now[0], "queued": now[1]})

    def marks(self, e: Event, own: Ownership) -> None:
        """The instants of ``e`` (before ``own`` applies it: a sync lands on the devices
        the rank holds at that moment)."""
        pid, t = e.pipeline, e.t
        args: dict[str, Any]
        match e:
            case Registered():
                for spec in e.clusters.values():
                    self.devices.update(spec.devices)
                self.on_pipeline(t, pid, "register", "pipeline", {})
            case Admitted():
                self.on_pipeline(t, pid, "admit", "pipeline", {})
            case Unregistered():
                self.on_pipeline(t, pid, "unregister", "pipeline", {"reason": e.reason})
            case Granted() | Expanded():
                self.devices.update(e.devices)
            case Shrunk():
                args = {"cluster": e.cluster, "ranks": e.ranks}
                self.on_devices(t, e.devices, f"{pid} shrink", "preemption", args)
            case Fenced():
                self.fences[(pid, e.rank)] = list(e.devices)
                args = {"rank": e.rank, "reason": e.reason, "holder": e.holder}
                self.on_devices(t, e.devices, f"{pid} fence", "fence", args)
            case Unfenced():
                devices = self.fences.pop((pid, e.rank), [])
                args = {"rank": e.rank, "reason": e.reason}
                self.on_devices(t, devices, f"{pid} unfence", "fence", args)
                if not devices:  # its fence is not in this journal (compacted away)
                    self.on_pipeline(t, pid, f"unfence rank {e.rank}", "fence", args)
            case WeightsPublished():
                args = {"version": e.version}
                self.on_pipeline(t, pid, f"publish v{e.version}", "weights", args)
            case ShardSynced():
                name, args = f"{pid} sync v{e.version}", {"rank": e.rank, "version": e.version}
                devices = own.rank_devices(pid, e.rank)
                self.on_devices(t, devices, name, "weights", args)
                if not devices:  # asleep by now, or a journal without its expand
                    self.on_pipeline(t, pid, name, "weights", args)

    def metadata(self) -> list[TraceEvent]:
        def meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> TraceEvent:
            return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}

        out = [
            meta("process_name", DEVICES_PID, 0, {"name": "devices"}),
            meta("process_sort_index", DEVICES_PID, 0, {"sort_index": DEVICES_PID}),
            meta("process_name", PIPELINES_PID, 0, {"name": "pipelines"}),
            meta("process_sort_index", PIPELINES_PID, 0, {"sort_index": PIPELINES_PID}),
        ]
        for d in sorted(self.devices):
            out.append(meta("thread_name", DEVICES_PID, d + 1, {"name": f"dev {d}"}))
            out.append(meta("thread_sort_index", DEVICES_PID, d + 1, {"sort_index": d}))
        for pipeline, tid in self.pipelines.items():
            out.append(meta("thread_name", PIPELINES_PID, tid, {"name": pipeline}))
            out.append(meta("thread_sort_index", PIPELINES_PID, tid, {"sort_index": tid}))
        return out


def build_trace(events: Iterable[Event], source: str = "") -> dict[str, Any]:
    """The Chrome trace of a journal's events (pure: no file is read or written)."""
    drawn = [e for e in events if isinstance(e, DRAWN)]
    t0 = min((e.t for e in drawn), default=0.0)
    trace = _Trace(t0)
    own = Ownership()
    for e in drawn:
        trace.marks(e, own)
        own.apply(e)
        trace.note_demand(e)
        for pid in sorted(own.changed):
            train, rollout = own.counts[pid]
            trace.counter(e.t, pid, "devices", {"train": train, "rollout": rollout})
        own.changed.clear()
    t_end = max((e.t for e in drawn), default=t0)
    for s in own.finish(t_end):
        trace.slice(s)
    # a stable order by time; at one ts the longer slice first, as nesting wants
    body = sorted(trace.events, key=lambda ev: (ev["ts"], -ev.get("dur", 0)))
    return {
        "traceEvents": trace.metadata() + body,
        "displayTimeUnit": "ms",
        "otherData": {"source": source, "t0_s": repr(t0), "events": str(len(drawn))},
    }


def write_trace(journal: str | Path, output: str | Path) -> Path:
    """``rlix-async trace``: read ``journal``, write its trace JSON to ``output``."""
    events = list(read_journal(journal))
    if not any(isinstance(e, DRAWN) for e in events):
        raise ValueError(f"{journal}: no scheduling events to trace")
    trace = build_trace(events, source=Path(journal).name)
    out = Path(output)
    out.write_bytes(msgspec.json.encode(trace))
    return out


# --- the format's rules, as Perfetto and chrome://tracing read them ---------------------

PHASES = ("X", "i", "I", "C", "M")
METADATA = {  # metadata event name -> the arg it must carry, and that arg's type
    "process_name": ("name", str),
    "thread_name": ("name", str),
    "process_sort_index": ("sort_index", int),
    "thread_sort_index": ("sort_index", int),
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def _is_time(x: object) -> bool:
    """A finite number >= 0 (bool is an int to Python, never to JSON readers)."""
    if isinstance(x, float):
        return math.isfinite(x) and x >= 0
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def trace_problems(trace: object) -> list[str]:
    """Every way ``trace`` breaks the Trace Event Format (JSON object form) for the
    phases written here: required keys per phase, times and durations numbers >= 0,
    pid/tid non-negative ints, counters with numeric args, complete slices of one
    thread nested or apart (never partly overlapping), a name for every process and
    thread an event lands on, and plain JSON. Empty: a trace Perfetto reads as meant."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    problems: list[str] = []
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {trace['displayTimeUnit']!r}: 'ms' or 'ns'")
    named: set[tuple[int, int | None]] = set()  # (pid, None): a process's name
    used: set[tuple[int, int | None]] = set()
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, ev in enumerate(trace["traceEvents"]):
        where = f"event {i} ({ev.get('ph')!r} {ev.get('name')!r})" if isinstance(ev, dict) else ""
        if not isinstance(ev, dict):
            problems.append(f"event {i}: not an object")
            continue
        ph, name = ev.get("ph"), ev.get("name")
        if ph not in PHASES:
            problems.append(f"{where}: phase not one of {PHASES}")
            continue
        if not isinstance(name, str) or not name:
            problems.append(f"{where}: no name")
        pid, tid = ev.get("pid"), ev.get("tid")
        if not (isinstance(pid, int) and _is_time(pid) and isinstance(tid, int) and _is_time(tid)):
            problems.append(f"{where}: pid and tid must be ints >= 0")
            continue
        args = ev.get("args", {})
        if not isinstance(args, dict):
            problems.append(f"{where}: args is not an object")
            continue
        if ph == "M":
            rule = METADATA.get(name) if isinstance(name, str) else None
            if rule is None or not isinstance(args.get(rule[0]), rule[1]):
                problems.append(f"{where}: metadata must be one of {sorted(METADATA)} with its arg")
            elif name == "process_name":
                named.add((pid, None))
            elif name == "thread_name":
                named.add((pid, tid))
            continue
        if not _is_time(ev.get("ts")):
            problems.append(f"{where}: ts must be a number >= 0")
            continue
        used.add((pid, None))
        if ph == "C":
            if not args or not all(_is_number(v) for v in args.values()):
                problems.append(f"{where}: a counter's args are its numeric values")
            continue
        used.add((pid, tid))
        if ph == "X":
            if not _is_time(ev.get("dur")):
                problems.append(f"{where}: dur must be a number >= 0")
                continue
            slices.setdefault((pid, tid), []).append((ev["ts"], ev["ts"] + ev["dur"], str(name)))
        elif ev.get("s", "t") not in ("t", "p", "g"):
            problems.append(f"{where}: an instant's scope s is 't', 'p' or 'g'")
    for (pid, tid), spans in slices.items():
        open_: list[tuple[float, float, str]] = []  # enclosing slices, innermost last
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1][1] <= start:
                open_.pop()
            if open_ and end > open_[-1][1]:
                problems.append(
                    f"pid {pid} tid {tid}: {name!r} [{start}, {end}] overlaps "
                    f"{open_[-1][2]!r} [{open_[-1][0]}, {open_[-1][1]}] without nesting"
                )
            open_.append((start, end, name))
    for pid, tid in sorted(used - named, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        problems.append(f"pid {pid}" + ("" if tid is None else f" tid {tid}") + " has no name")
    try:
        json.dumps(trace, allow_nan=False)
    except (TypeError, ValueError) as exc:
        problems.append(f"not plain JSON: {exc}")
    return problems
