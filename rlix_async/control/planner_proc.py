"""The planner in a child process of the coordinator.

At 4,096 devices x 256 pipelines a plan costs 30-50 ms of Python. In a thread of
the coordinator it holds the GIL that long, and every socket call the event loop
makes meanwhile waits for it back: calls and heartbeats stall behind the plan. In
a process of its own it takes nothing from the loop (docs/PERF.md, "Coordinator
at cluster scale").

The wire is the coordinator's own: a length-prefixed msgpack ``Snapshot`` on the
child's stdin, a length-prefixed msgpack ``PlanReply`` on its stdout; typed
decoding, no pickle. :meth:`PlannerProcess.plan` blocks (the coordinator calls it
from its planner thread; the pipe I/O releases the GIL). A child that dies is
started again and the plan asked once more; a plan that raises comes back as an
error, like a planner bug in the thread did.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import subprocess
import sys
import threading
from typing import IO

import msgspec

from rlix_async.control.planner import plan
from rlix_async.control.snapshot import Plan, Snapshot

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


class PlannerProcess:
    """One planner child, asked one snapshot at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one plan in flight on the pipe
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PlanReply)
        self.restarts = 0

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rlix_async.control.planner_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def plan(self, snap: Snapshot) -> Plan:
        data = self._encoder.encode(snap)
        with self._lock:
            for attempt in (1, 2):
                reply = self._ask(data)
                if reply is not None:
                    break
                log.error("planner process died (attempt %d); starting a new one", attempt)
                self._stop()
                self.restarts += 1
                self.start()
            else:
                raise PlannerError("the planner process died twice on one snapshot")
        if reply.error is not None or reply.plan is None:
            raise PlannerError(f"planner failed: {reply.error}")
        return reply.plan

    def _ask(self, data: bytes) -> PlanReply | None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            return None
        try:
            _write_frame(proc.stdin, data)
            answer = _read_frame(proc.stdout)
        except (BrokenPipeError, ValueError, OSError):
            return None
        return None if answer is None else self._decoder.decode(answer)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
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
