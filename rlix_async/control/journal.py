"""Append-only JSONL journal of scheduling events, and replay after a restart.

Each line: ``{"t": unix_time, "ev": EVENT, "pipeline": ID, ...}``. Events:
register (clusters), admit, unregister, request, grant (cluster, priority,
devices), release (cluster), shrink / expand (cluster, ranks, devices),
progress (stream, target, completed). ``rlix-async timeline`` draws the same file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import msgspec

from rlix_async.control.registry import Registry
from rlix_async.control.topology import ClusterSpec, Priority

log = logging.getLogger(__name__)


class Journal:
    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._fh: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", buffering=1)  # line-buffered: each event hits the OS

    def write(self, ev: str, **fields: Any) -> None:
        if self._fh is None:
            return
        record = {"t": round(time.time(), 6), "ev": ev, **fields}
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")

    def sync(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_journal(path: str | Path) -> Iterator[dict[str, Any]]:
    """Events in order; a torn last line (crash mid-write) is skipped."""
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable journal line skipped", path, lineno)


def replay(path: str | Path, registry: Registry) -> int:
    """Rebuild registrations, held stages, awake ranks and progress. Returns events read.

    Queued requests are not replayed: their drivers re-send them when they
    reconnect (the client library's Resume), which is the authoritative copy.
    """
    if not Path(path).exists():
        return 0
    n = 0
    for e in read_journal(path):
        n += 1
        pid = e.get("pipeline")
        ev = e.get("ev")
        try:
            if ev == "register":
                clusters = {
                    name: msgspec.convert(spec, ClusterSpec) for name, spec in e["clusters"].items()
                }
                registry.register(pid, clusters)
            elif pid not in registry.pipelines:
                continue
            elif ev == "admit":
                registry.admit(pid)
            elif ev == "unregister":
                registry.remove(pid)
            elif ev == "grant":
                registry.pipelines[pid].held[e["cluster"]] = Priority[e["priority"]]
            elif ev == "release":
                registry.pipelines[pid].held.pop(e["cluster"], None)
            elif ev == "expand":
                registry.pipelines[pid].active.update(e["ranks"])
            elif ev == "shrink":
                registry.pipelines[pid].active.difference_update(e["ranks"])
            elif ev == "progress":
                registry.report_progress(pid, e["stream"], e["target"], e["completed"])
            elif ev == "clear_progress":
                registry.clear_progress(pid, e.get("stream"))
        except (KeyError, ValueError, TypeError, msgspec.ValidationError) as exc:
            log.warning("journal event %d (%s) not replayed: %s", n, ev, exc)
    return n
