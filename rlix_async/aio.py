"""asyncio helpers: a uvloop-aware runner and supervised background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class Supervisor:
    """Owns background tasks: none is lost, every failure is logged and reported.

    A task that raises (anything but cancellation) is logged with its traceback
    and passed to ``on_failure`` so its owner can react (restart it, mark a peer
    dead, shut down); it is never silently dropped.
    """

    def __init__(
        self,
        name: str,
        on_failure: Callable[[str, BaseException], Any] | None = None,
    ) -> None:
        self.name = name
        self.on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failures = 0

    def spawn(self, coro: Awaitable[T], name: str) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)  # type: ignore[assignment]
        task.set_name(f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self.failures += 1
        log.error("task %s failed", task.get_name(), exc_info=exc)
        if self.on_failure is not None:
            try:
                self.on_failure(task.get_name(), exc)
            except Exception:
                log.exception("on_failure handler of %s raised", self.name)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout: float = 5.0) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


class TurnPacer:
    """Lets at most ``per_turn`` callers of :meth:`turn` on per turn of the event loop;
    the others wait, first come first served, for the following turns.

    Why: a turn of the loop runs every callback that was ready when it began. A plan
    at cluster scale starts a command for each of hundreds of shards, and their
    acknowledgements come back together; unpaced, a thousand such steps run in one
    turn (over 100 ms of CPU) while a driver's call waits behind them. Paced, the
    loop reads its sockets between every ``per_turn`` of them. A caller with budget
    left in the turn passes without waiting. The bound is loose by up to a factor of
    two: waiters released in one turn run in the next, where callers that pass at
    once may spend that turn's budget beside them.
    """

    def __init__(self, per_turn: int) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn must be at least 1, got {per_turn}")
        self.per_turn = per_turn
        self._left = per_turn
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._refill_due = False
        self.waited = 0  # callers that had to wait (for tests and benchmarks)

    async def turn(self) -> None:
        if self._left > 0 and not self._waiting:
            self._left -= 1
            self._refill_soon()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.waited += 1
        self._refill_soon()
        await fut

    def _refill_soon(self) -> None:
        if not self._refill_due:
            self._refill_due = True
            asyncio.get_running_loop().call_soon(self._refill)

    def _refill(self) -> None:
        """A new turn: a fresh budget, spent first on those waiting longest."""
        self._refill_due = False
        self._left = self.per_turn
        while self._left and self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():  # (a cancelled waiter takes nothing)
                fut.set_result(None)
                self._left -= 1
        if self._waiting:
            self._refill_soon()


def stop_signals() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM, its handlers installed before this returns: a
    process installs them before it says READY, so a stop sent right after is a clean
    stop, not the default action (death by signal)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def until_signalled() -> None:
    """Return on SIGINT or SIGTERM (a process main serves until then)."""
    await stop_signals().wait()
