"""The planner in a child process of the coordinator.

At 4,096 devices x 256 pipelines a plan costs 30-50 ms of Python. In a thread of
the coordinator it holds the GIL that long, and every socket call the event loop
makes meanwhile waits for it back: calls and heartbeats stall behind the plan. In
a process of its own it takes nothing from the loop (docs/PERF.md, "Coordinator
at cluster scale").

The wire is the coordinator's own: a length-prefixed msgpack ``Snapshot`` on the
child's stdin, a length-prefixed msgpack ``PlanReply`` on its stdout; typed
decoding, no pickle. :meth:`PlannerProcess.plan` blocks (the coordinator calls it
from its planner thread; the pipe I/O releases the GIL), at most ``timeout_s``: a
child that hangs is killed and started again and the step fails (the scheduler
plans again on the next event). A child that dies is started again and the plan
asked once more; a plan that raises comes back as an error, like a planner bug in
the thread did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO

import msgspec

from rlix_async.control.planner import plan
from rlix_async.protocols.snapshot import Plan, Snapshot

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
STOP_TIMEOUT_S = 5.0


class PlanReply(msgspec.Struct, frozen=True):
    plan: Plan | None = None
    error: str | None = None  # the planner raised: its exception, in one line


class PlannerError(RuntimeError):
    """The planner raised on a snapshot, or its process could not answer."""


def _write_frame(out: IO[bytes], data: bytes) -> None:
    out.write(_LEN.pack(len(data)))
    out.write(data)
    out.flush()


def _read_frame(inp: IO[bytes]) -> bytes | None:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None  # the other end closed
    (n,) = _LEN.unpack(head)
    data = inp.read(n)
    if len(data) < n:
        return None
    return data


class PlannerTimeout(PlannerError):
    """The planner process did not answer in time (it was killed and restarted)."""


def _send_all(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise PlannerTimeout("the planner process took no snapshot")
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue


def _recv_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes, None at end of file (the child died)."""
    parts: list[bytes] = []
    while n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise PlannerTimeout("the planner process did not answer")
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


class PlannerProcess:
    """One planner child, asked one snapshot at a time, each answer within
    ``timeout_s`` (a plan at 4,096 devices takes tens of ms: more is a hang)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one plan in flight on the pipe
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PlanReply)
        self.restarts = 0
        self._closed = False

    def start(self) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlix_async.control.planner_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # read and written by fd, with deadlines
            start_new_session=True,  # a Ctrl-C meant for the coordinator is its to handle
        )
        assert proc.stdin is not None
        # a blocking write of a snapshot bigger than the pipe's buffer would wait for a
        # hung child past any deadline: written without blocking, select in between
        os.set_blocking(proc.stdin.fileno(), False)
        self._proc = proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def plan(self, snap: Snapshot) -> Plan:
        data = self._encoder.encode(snap)
        with self._lock:
            for attempt in (1, 2):
                try:
                    reply = self._ask(data)
                except PlannerTimeout as exc:
                    self._restart(f"{exc} in {self.timeout_s:g} s", kill=True)
                    raise PlannerTimeout(f"{exc} in {self.timeout_s:g} s; restarted") from None
                if reply is not None:
                    break
                self._restart(f"the planner process died (attempt {attempt})")
            else:
                raise PlannerError("the planner process died twice on one snapshot")
        if reply.error is not None or reply.plan is None:
            raise PlannerError(f"planner failed: {reply.error}")
        return reply.plan

    def _restart(self, why: str, *, kill: bool = False) -> None:
        if self._closed:
            raise PlannerError("the planner process is closed")
        log.error("%s: starting a new one", why)
        self._stop(kill=kill)
        self.restarts += 1
        self.start()

    def _ask(self, data: bytes) -> PlanReply | None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            return None
        deadline = time.monotonic() + self.timeout_s
        try:
            _send_all(proc.stdin.fileno(), _LEN.pack(len(data)) + data, deadline)
            head = _recv_exact(proc.stdout.fileno(), _LEN.size, deadline)
            if head is None:
                return None
            answer = _recv_exact(proc.stdout.fileno(), _LEN.unpack(head)[0], deadline)
        except (BrokenPipeError, ValueError, OSError):
            return None
        if answer is None:
            return None
        try:
            return self._decoder.decode(answer)
        except msgspec.DecodeError:  # out of step with us: as good as dead
            log.error("the planner process answered %d bytes that are not a plan", len(answer))
            return None

    def close(self) -> None:
        proc = self._proc
        self._closed = True
        if proc is not None:  # first: a plan in flight then fails at once, not after
            proc.kill()  # timeout_s, and releases the lock
        with self._lock:
            self._stop()

    def _stop(self, *, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:  # hung: it would not read the end of file
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a dead child's pipe cannot flush
                    pipe.close()  # the child reads end-of-file and exits
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


def main() -> None:
    """The child: plan every snapshot that arrives until stdin closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    decoder = msgspec.msgpack.Decoder(Snapshot)
    encoder = msgspec.msgpack.Encoder()
    while (data := _read_frame(inp)) is not None:
        try:
            reply = PlanReply(plan=plan(decoder.decode(data)))
        except Exception as exc:  # a planner bug: the coordinator logs it and goes on
            reply = PlanReply(error=f"{type(exc).__name__}: {exc}")
        _write_frame(out, encoder.encode(reply))


if __name__ == "__main__":
    main()
