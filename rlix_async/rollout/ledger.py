"""The trajectory ledger: what a pipeline asked for and what became of it, across restarts.

``OUT/<id>/ledger.jsonl``, append-only, written by rank 0 (one ``write`` per
line, so a ``kill -9`` cuts at a line boundary and never takes back a line
written before it). Counters restored from a checkpoint cannot show what a kill
cost: the work done after that checkpoint vanishes from them. The ledger keeps
it, and a restart names what it did not get back.

A group (``group_size`` trajectories of one prompt; a trajectory is its group's
id and its index) is named ``r<run>-g<seq>``: ``run`` counts the pipeline's
starts in this ledger, ``seq`` its groups in that run. Events (``ev``):

- ``start``: a process began; ``fresh`` (a new run, not ``--resume``), the step it
  resumed from and the ids of the groups its checkpoint's buffer brought back;
- ``requested``: a group's ``n`` requests went to the router, at trainer version ``v``;
  text recipes add ``row``, the prompt's position in the training set (the data order);
- ``finished``: they came back: ``ok`` with tokens, ``failed`` (raised),
  ``cancelled`` (stopped early: a finished sibling had made the group too old), and
  the ``outcome``: ``buffered``, ``stale`` (dropped at once), ``unusable`` (fewer
  than two answers: nothing to compare, discarded) or ``filtered`` (every answer
  scored alike, dropped by ``rollout.drop_uniform_groups``: by choice, not lost);
- ``dropped``: buffered groups too old for trainer version ``v``;
- ``taken``: the groups of the batch trained at version ``v`` (into step ``v + 1``);
- ``checkpoint``: the checkpoint of ``step`` is on disk: what was taken below that
  version is trained for good;
- ``end``: the pipeline finished its steps.

``tally`` replays it. A trajectory is trained only once the checkpoint of its step is
written: a kill before that rolls the step back. At a restart from step ``S``,
whatever was finished, in flight, or taken at version ``S`` or later, and did not come
back in the checkpoint's buffer, is lost: its work is done again. At ``end`` what is
still buffered or in flight is left over (not needed: the steps are done).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rlix_async.protocols.batch import Group

LEDGER = "ledger.jsonl"
log = logging.getLogger(__name__)


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete line; a torn last line (a machine crash mid-write) is skipped."""
    if not path.exists():
        return
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                return
            try:
                event = json.loads(line)
            except ValueError:  # a line a crash tore, with another glued on (older runs)
                log.warning("%s: unreadable ledger line skipped", path)
                continue
            if isinstance(event, dict) and "ev" in event:
                yield event


def _cut_torn_tail(path: Path) -> None:
    """Truncate after the last newline: what a crash mid-write left is not a line."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: cut off %d bytes of a torn last line", path, len(data) - end)
        os.truncate(path, end)


class Ledger:
    """Rank 0's writer. Opening it records the start of a run (or of a resumed one)."""

    def __init__(self, path: Path, *, fresh: bool, from_step: int, buffered: list[Group]) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(path)  # the first line we append must not glue onto a fragment
        self.run = sum(1 for e in read_events(path) if e["ev"] == "start")
        self._seq = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._write(
            ev="start",
            run=self.run,
            fresh=fresh,
            from_step=from_step,
            buffer=[g.id for g in buffered],
        )

    def _write(self, **event: Any) -> None:
        if self._fd < 0:
            raise RuntimeError(f"{self.path}: written after close ({event['ev']})")
        event["time"] = round(time.time(), 3)
        # one write of one whole line to an O_APPEND file: nothing a kill can half-do
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def new_id(self) -> str:
        self._seq += 1
        return f"r{self.run}-g{self._seq}"

    def requested(self, gid: str, n: int, version: int, row: int = -1) -> None:
        if row >= 0:
            self._write(ev="requested", g=gid, n=n, v=version, row=row)
        else:
            self._write(ev="requested", g=gid, n=n, v=version)

    def finished(self, gid: str, ok: int, failed: int, cancelled: int, outcome: str) -> None:
        self._write(
            ev="finished", g=gid, ok=ok, failed=failed, cancelled=cancelled, outcome=outcome
        )

    def dropped(self, groups: list[Group], version: int) -> None:
        self._write(ev="dropped", g=[g.id for g in groups], v=version)

    def taken(self, groups: list[Group], version: int) -> None:
        self._write(ev="taken", g=[g.id for g in groups], v=version)

    def checkpoint(self, step: int, buffered: list[Group]) -> None:
        self._write(ev="checkpoint", step=step, buffer=[g.id for g in buffered])

    def end(self, step: int) -> None:
        self._write(ev="end", step=step)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Tally:
    """Trajectories of the latest run (from its last fresh start), by what became of them.

    ``requested`` is the sum of every other field but ``generated`` and ``restarts``."""

    requested: int = 0
    generated: int = 0  # came back with tokens, whatever became of them after
    trained: int = 0  # in a step whose checkpoint was written
    dropped_stale: int = 0  # finished too old to train on
    cancelled_stale: int = 0  # stopped early: their group was already too old
    left_over: int = 0  # buffered or in flight when the pipeline finished its steps
    pending: int = 0  # buffered, in flight or in an unsaved step: the run is not over
    failed: int = 0  # their generation raised
    discarded: int = 0  # finished, but too few of their group did to use it
    filtered: int = 0  # their group's rewards were all equal (drop_uniform_groups): not lost
    lost_to_restarts: int = 0  # finished, in flight or trained after the checkpoint resumed from
    restarts: int = 0

    @property
    def lost(self) -> int:
        return self.failed + self.discarded + self.lost_to_restarts

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"lost": self.lost}


@dataclass
class _Group:
    n: int
    # flight buffered taken | trained dropped lost discarded filtered left_over
    state: str = "flight"
    live: int = 0  # its trajectories that the state is about (the finished ones, once back)
    version: int = 0  # the version it was taken at
    failed: int = 0
    cancelled: int = 0
    back: bool = False  # its requests came back (generated, whatever came of them)


def tally(path: Path) -> Tally:
    groups: dict[str, _Group] = {}
    restarts = 0
    ended = False
    for e in read_events(path):
        ev = e["ev"]
        if ev == "start":
            ended = False
            if e["fresh"]:
                groups, restarts = {}, 0
                continue
            restarts += 1
            _restart(groups, e["from_step"], set(e["buffer"]))
            continue
        if ended:  # nothing after the end of a run counts until the next start
            continue
        if ev == "requested":
            groups[e["g"]] = _Group(e["n"], live=e["n"])
        elif ev == "finished":
            g = groups[e["g"]]
            g.failed, g.cancelled, g.live, g.back = e["failed"], e["cancelled"], e["ok"], True
            g.state = {"buffered": "buffered", "stale": "dropped", "filtered": "filtered"}.get(
                e["outcome"], "discarded"
            )
        elif ev in ("dropped", "taken"):
            for gid in e["g"]:
                if gid in groups:  # a checkpoint from before the ledger: ids unknown
                    groups[gid].state, groups[gid].version = ev, e["v"]
        elif ev == "checkpoint":
            for g in groups.values():
                if g.state == "taken" and g.version < e["step"]:
                    g.state = "trained"
        elif ev == "end":
            ended = True
            for g in groups.values():
                if g.state == "taken" and g.version < e["step"]:
                    g.state = "trained"
                elif g.state in ("flight", "buffered"):
                    g.state = "left_over"
    t = Tally(restarts=restarts)
    for g in groups.values():
        t.requested += g.n
        t.failed += g.failed
        t.cancelled_stale += g.cancelled
        if g.back:
            t.generated += g.live
        state = "dropped_stale" if g.state == "dropped" else g.state
        if state == "lost":
            state = "lost_to_restarts"
        elif state in ("flight", "buffered", "taken"):
            state = "pending"
        setattr(t, state, getattr(t, state) + g.live)
    return t


def _restart(groups: dict[str, _Group], from_step: int, buffered: set[str]) -> None:
    """A process resumed from the checkpoint of ``from_step``: what it has is that
    checkpoint's buffer and the steps before it; the rest of the previous process's
    work is gone."""
    for gid, g in groups.items():
        if gid in buffered:
            g.state = "buffered"  # back, whatever happened to it after the checkpoint
        elif g.state == "taken" and g.version < from_step:
            g.state = "trained"  # its checkpoint was written; the kill beat the ledger line
        elif (g.state == "trained" and g.version >= from_step) or g.state in (
            "flight",
            "buffered",
            "taken",
        ):
            g.state = "lost"
