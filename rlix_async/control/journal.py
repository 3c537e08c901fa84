"""The scheduling journal: typed events, appended as JSON lines, replayed after a restart.

Every line is one :data:`Event`, tagged by ``ev`` (``{"ev": "grant", "t": ...,
"pipeline": ...}``). The coordinator writes them, the simulator writes the
same events on simulated time, ``rlix-async timeline`` draws them and a
restarted coordinator replays them into its registry (``Event.apply``).

Whatever the file holds, a restart comes up (docs/JOURNAL.md): a line that is
not an event is skipped, an event that no longer applies to the registry is
reported and skipped, and a torn or unreadable tail is cut off before anything
is appended after it. A write that fails raises :class:`JournalWriteError`
before the caller acts on the event; lease-changing events are fsynced before
``record`` returns (``fsync="leases"``); and :func:`open_journal` compacts a long
history into one :class:`RegistrySnapshot`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from rlix_async.control.events import (  # noqa: F401  (re-exported: journal.X is the event vocabulary)
    LEASE_EVENTS,
    Admitted,
    Event,
    Expanded,
    Fenced,
    FenceRecord,
    Granted,
    InapplicableEvent,
    JournalEvent,
    PipelineRecord,
    ProgressCleared,
    ProgressRecord,
    ProgressReported,
    Registered,
    RegistrySnapshot,
    Released,
    Requested,
    ShardJoined,
    ShardSynced,
    Shrunk,
    Unfenced,
    Unregistered,
    WeightsPublished,
    WorkerRecord,
)
from rlix_async.control.registry import Registry
from rlix_async.transport.types import Deferred

log = logging.getLogger(__name__)
T = TypeVar("T")

# Journals longer than this (events) are compacted into one snapshot when a
# coordinator opens them: large enough that a run's timeline is never cut short
# in practice (a busy coordinator writes a few events a second), small enough
# that a restart replays in about a second (docs/JOURNAL.md).
COMPACT_OVER = 100_000
# Per read or replay, at most this many skipped lines or events are logged one by
# one (then one line with the total): a damaged file must not flood the log.
MAX_WARNINGS = 10

FsyncPolicy = Literal["never", "leases", "always"]


class JournalWriteError(OSError):
    """An event could not be written (disk full, I/O error, journal closed). Raised by
    :meth:`Journal.record` before the caller acts on the event, so a plan whose record
    fails is not carried out; the file is left ending at the last whole event."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


# --- reading and replaying ------------------------------------------------------------------

_BLANKS = b" \t\r\n"  # JSON whitespace: around an event on its line


@dataclass(frozen=True)
class _Unreadable:
    """A line that is not a known event. ``record``: a whole JSON object all the same (an
    event of another version): skipped, but never cut off as a torn tail."""

    record: bool
    why: str


def _decode(line: bytes) -> Event | _Unreadable:
    try:
        return _decoder.decode(line)
    except Exception as exc:  # any bytes: invalid UTF-8 raises UnicodeDecodeError, say
        why = f"{type(exc).__name__}: {exc}"
    try:
        record = isinstance(msgspec.json.decode(line), dict)
    except Exception:
        record = False
    return _Unreadable(record, why)


def _is_record(line: bytes) -> bool:
    item = _decode(line)
    return not isinstance(item, _Unreadable) or item.record


@dataclass
class ReplayStats:
    """What opening or replaying a journal found."""

    events: int = 0  # events read (each replayed or skipped)
    skipped: int = 0  # events that no longer applied to the registry
    unreadable: int = 0  # lines that were not events (skipped)
    cut_bytes: int = 0  # torn or unreadable tail cut off before appending
    compacted: bool = False  # the file was rewritten as one snapshot


def _read(path: str | Path, stats: ReplayStats) -> Iterator[Event]:
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.strip(_BLANKS)
            if not line:
                continue
            item = _decode(line)
            if isinstance(item, _Unreadable):
                stats.unreadable += 1
                if stats.unreadable <= MAX_WARNINGS:
                    log.warning(
                        "%s:%d: unreadable journal line skipped (%s)", path, lineno, item.why
                    )
                continue
            yield item
    if stats.unreadable > MAX_WARNINGS:
        log.warning("%s: %d unreadable journal lines skipped in all", path, stats.unreadable)


def read_journal(path: str | Path) -> Iterator[Event]:
    """Events in order. A line that is not a known event (a torn last line after a crash
    mid-write, bytes a disk mangled, an event from a newer version) is skipped with a
    warning; no content raises."""
    yield from _read(path, ReplayStats())


def replay_events(
    events: Iterable[Event], registry: Registry, stats: ReplayStats | None = None
) -> ReplayStats:
    """Apply events in order. One that fails (it no longer applies, or any error at all)
    is reported and skipped: a restart must come up whatever the journal holds."""
    stats = stats if stats is not None else ReplayStats()
    for event in events:
        stats.events += 1
        try:
            event.apply(registry)
        except Exception as exc:
            stats.skipped += 1
            if stats.skipped <= MAX_WARNINGS:
                log.warning(
                    "journal event %d (%s of %r) not replayed: %s",
                    stats.events,
                    type(event).__name__,
                    event.pipeline,
                    exc,
                )
    if stats.skipped > MAX_WARNINGS:
        log.warning("journal: %d events not replayed in all", stats.skipped)
    return stats


def replay(path: str | Path, registry: Registry) -> int:
    """Rebuild registrations, held stages, awake ranks, fences and progress. Returns the
    number of events read.

    Queued requests are not replayed: their drivers re-send them when they
    reconnect (the client library's Resume), which is the authoritative copy.
    """
    if not Path(path).exists():
        return 0
    stats = ReplayStats()
    replay_events(_read(path, stats), registry, stats)
    return stats.events


def write_journal(path: str | Path, events: Iterable[Event]) -> None:
    with open(path, "wb") as fh:
        for event in events:
            fh.write(_encoder.encode(event) + b"\n")


# --- appending -----------------------------------------------------------------------------


def _tail_start(fd: int, size: int) -> tuple[int, bool]:
    """Where the tail after the file's last record begins (``size``: no tail), and whether
    that record lacks its newline. Read backwards from the end: a torn tail is a line
    or two, and the rest of the file is not read."""
    span = 1 << 16
    while True:
        base = max(0, size - span)
        data = os.pread(fd, size - base, base)
        end, newline = len(data), False  # the piece before `end`, followed by a newline?
        while True:
            nl = data.rfind(b"\n", 0, end)
            if nl < 0 and base > 0:
                break  # the piece may start before this block: read a larger one
            piece = data[nl + 1 : end].strip(_BLANKS)
            if piece and _is_record(piece):
                return base + end + (1 if newline else 0), not newline
            if nl < 0:
                return 0, False  # not one record in the file
            end, newline = nl, True
        span *= 4


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # (a regular file says 0 only when it cannot take more)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def _fsync_dir(directory: Path) -> None:
    """Make a file's creation or rename itself survive a power loss."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("journal directory %s not synced: %s", directory, exc)


class Journal:
    """Appends events to a JSONL file (nothing when ``path`` is None), one write(2) each:
    an event that ``record`` returned from is in the OS, so a crash of the process
    loses nothing. ``fsync`` says what a power loss may lose (docs/JOURNAL.md):
    ``"leases"`` (default) fsyncs every event in :data:`LEASE_EVENTS` before
    ``record`` returns (once per :meth:`batch`), ``"always"`` every event,
    ``"never"`` none (the OS writes them back within about 30 s).

    Opening cuts off a torn or unreadable tail (everything after the last whole
    record: a line a crash tore, bytes a power loss zeroed), saving it next to the
    journal as ``PATH.cut``, so the first append never glues onto a fragment. One
    process appends to a journal at a time.
    """

    def __init__(
        self,
        path: str | Path | None,
        clock: Callable[[], float] = time.time,
        *,
        fsync: FsyncPolicy = "leases",
    ) -> None:
        self.path = Path(path) if path else None
        self.clock = clock
        self.fsync = fsync
        self.cut_bytes = 0  # cut off the tail when opened
        # events in the file (open_journal counts those it replayed; a plain open counts
        # what it appends), 1 after a compaction: when maybe_compact compacts
        self.events = 0
        self._fd: int | None = None
        self._regular = False  # a regular file (not /dev/null, a pipe): truncated, fsynced
        self._end = 0  # the file's size after the last whole event appended
        self._torn = False  # a failed write may have left a fragment past _end
        self._batches = 0
        self._unsynced = False
        # Told of every failed write before it is raised: the coordinator, whose
        # registry already holds the event, exits to be rebuilt from what was written.
        self.on_error: Callable[[JournalWriteError], None] | None = None
        if self.path is not None:
            self._open(self.path)

    def _open(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            created = not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise JournalWriteError(
                exc.errno, f"journal not opened: {exc.strerror}", str(path)
            ) from exc
        self._fd = fd
        self._end, self._torn, self._unsynced = 0, False, False
        st = os.fstat(fd)
        self._regular = stat.S_ISREG(st.st_mode)
        if not self._regular:
            return
        try:
            self._end = self._repair(fd, path, st.st_size)
        except OSError as exc:
            self.close()
            raise JournalWriteError(
                exc.errno, f"journal tail not repaired: {exc.strerror}", str(path)
            ) from exc
        if created:
            _fsync_dir(path.parent)

    def _repair(self, fd: int, path: Path, size: int) -> int:
        """Cut the tail after the last record; end that record with its newline. Returns
        the file's size after."""
        start, needs_newline = _tail_start(fd, size)
        if start < size:
            self.cut_bytes = size - start
            saved = path.with_name(path.name + ".cut")
            try:  # a record of what was cut, for whoever looks into why
                with saved.open("ab") as fh:
                    fh.write(os.pread(fd, size - start, start))
                where = f"saved in {saved}"
            except OSError as exc:
                where = f"not saved: {exc}"
            os.ftruncate(fd, start)
            log.warning(
                "journal %s: cut off %d bytes of torn or unreadable tail after its last "
                "whole event (%s)",
                path,
                self.cut_bytes,
                where,
            )
        if needs_newline:
            os.write(fd, b"\n")
            start += 1
        if self.cut_bytes or needs_newline:
            os.fsync(fd)
        return start

    def record(self, event: Event, *, sync: bool = True) -> None:
        """Append one event; raises :class:`JournalWriteError` when it is not written
        (or, under the fsync policy, not synced), in which case the caller must not act
        on it. With ``sync=False`` the fsync the policy asks for is left to the
        caller (:class:`SharedFsync`, or a batch's end)."""
        event.t = round(self.clock(), 6)
        if self.path is None:
            return
        try:
            self._append(_encoder.encode(event) + b"\n")
            self.events += 1
            lease = isinstance(event, LEASE_EVENTS)
            if self.fsync == "always" or (self.fsync == "leases" and lease):
                self._unsynced = True
                if sync and not self._batches:
                    self.sync()
        except JournalWriteError as exc:
            if self.on_error is not None:
                self.on_error(exc)
            raise

    def _append(self, line: bytes) -> None:
        fd = self._fd
        if fd is None:
            raise JournalWriteError(errno.EBADF, "journal is closed: event not recorded")
        try:
            if self._torn:  # a fragment a failed write left: never glue an event onto it
                os.ftruncate(fd, self._end)
                self._torn = False
            _write_all(fd, line)
        except OSError as exc:
            if self._regular:
                self._torn = True
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self._end)
                    self._torn = False
            raise JournalWriteError(
                exc.errno,
                f"journal write failed, event not recorded: {exc.strerror}",
                str(self.path),
            ) from exc
        self._end += len(line)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """One fsync for the events recorded inside (a plan's), when the block ends:
        durable together before the plan they record is carried out."""
        self._batches += 1
        try:
            yield
        finally:
            self._batches -= 1
            if not self._batches and self._unsynced:
                self.sync()

    def sync(self) -> None:
        """Flush what was written to the disk (raises :class:`JournalWriteError`)."""
        if self._fd is None or not self._regular:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            error = JournalWriteError(
                exc.errno, f"journal fsync failed: {exc.strerror}", str(self.path)
            )
            if self.on_error is not None:  # (record's own sync reports through record)
                self.on_error(error)
            raise error from exc
        self._unsynced = False

    @property
    def unsynced(self) -> bool:
        """Written events the fsync policy wants on disk are not yet."""
        return self._unsynced

    def compact(self, registry: Registry) -> None:
        """Rewrite the file as one :class:`RegistrySnapshot` of ``registry``, atomically
        (a temporary file, fsynced, renamed over it), and append after it from now on.
        ``registry`` must hold what replaying the file gives (open_journal calls this
        right after replay): history is gone, ``timeline`` draws from the snapshot on.
        If writing the snapshot fails, the file and this journal are as they were."""
        if self.path is None or self._fd is None or not self._regular:
            return
        snapshot = RegistrySnapshot.of(registry)
        snapshot.t = round(self.clock(), 6)
        data = _encoder.encode(snapshot) + b"\n"
        tmp = self.path.with_name(f".{self.path.name}.compacting")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise JournalWriteError(
                exc.errno, f"journal not compacted: {exc.strerror}", str(self.path)
            ) from exc
        # The path is the snapshot now; the open descriptor is the old, unlinked file.
        self.close()
        self._open(self.path)
        self.events = 1
        _fsync_dir(self.path.parent)

    def maybe_compact(self, registry: Registry, over: int = COMPACT_OVER) -> bool:
        """Compact once the file holds more than ``over`` events; True when it did. Safe
        between two handlers of a running coordinator (every change to ``registry`` is
        recorded by then). A failure is logged, and tried again ``over`` events later."""
        if self.events <= over:
            return False
        try:
            self.compact(registry)
        except JournalWriteError as exc:
            self.events = 0  # not again at every call: after as many events again
            log.warning("%s; appending to it as it is", exc)
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as exc:  # at shutdown: say so, do not fail the shutdown
                log.warning("journal %s: close failed: %s", self.path, exc)


def open_journal(
    path: str | Path,
    registry: Registry,
    *,
    clock: Callable[[], float] = time.time,
    fsync: FsyncPolicy = "leases",
    compact_over: int | None = COMPACT_OVER,
) -> tuple[Journal, ReplayStats]:
    """What a restarting coordinator does with its journal: cut off a damaged tail,
    replay the rest into ``registry``, compact it into one snapshot when it holds more
    than ``compact_over`` events (None: never), and append from there."""
    journal = Journal(path, clock, fsync=fsync)  # first: replay reads what appends follow
    stats = ReplayStats(cut_bytes=journal.cut_bytes)
    replay_events(_read(path, stats), registry, stats)
    journal.events = stats.events
    if compact_over is not None:
        stats.compacted = journal.maybe_compact(registry, compact_over)
    return journal, stats


class SharedFsync:
    """Group commit: the handlers of one turn of the loop share one fsync. A handler
    records with ``sync=False`` and returns :meth:`reply_after`, a
    :class:`~rlix_async.transport.Deferred` reply; one fsync on the next turn makes
    every event recorded meanwhile durable, then all those replies go out. At 4,096
    peers, 70 ReleaseStage calls came in one burst and, fsynced one by one, took
    30 ms of the loop (docs/PERF.md)."""

    def __init__(self, journal: Callable[[], Journal]) -> None:
        self._journal = journal  # the owner's current journal (it may be reopened)
        self._waiting: list[tuple[Deferred, Any]] = []
        self.syncs = 0  # fsyncs done for the group (for tests and benchmarks)

    def reply_after(self, reply: T) -> T | Deferred:
        """``reply`` once what was recorded is durable: itself at once when nothing
        waits for an fsync, else a Deferred of it, answered after the next group
        fsync (or failed with that fsync's :class:`JournalWriteError`)."""
        if not self._journal().unsynced:
            return reply
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._sync)
        later = Deferred()
        self._waiting.append((later, reply))
        return later

    def _sync(self) -> None:
        waiting, self._waiting = self._waiting, []
        try:
            journal = self._journal()
            if journal.unsynced:  # (a plan's batch may have synced them already)
                self.syncs += 1
                journal.sync()
        except JournalWriteError as exc:
            for later, _ in waiting:
                later.fail(exc)
            return
        for later, reply in waiting:
            later.resolve(reply)
