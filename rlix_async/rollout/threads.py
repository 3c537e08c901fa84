"""Threads for user code that is not ``async def`` (rewards, env methods).

Such code runs off the event loop, in a pool of its own: never in the loop's default
pool, which runs the trainer's steps and checkpoints. A call holds its slot until its
thread is free again, not until its caller gives up, so a caller's timeout starts once
a thread runs the call, never in a queue. A thread cannot be killed: a call its caller
gave up on while it ran keeps its thread, and is counted in ``stuck`` until it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any


class NoFreeThread(RuntimeError):
    """Every thread stayed busy past the wait (calls that timed out may hold them all)."""


class BoundedThreads:
    def __init__(self, max_threads: int, name: str) -> None:
        self.max_threads, self.name = max_threads, name
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix=name)
        self._slots = asyncio.Semaphore(max_threads)
        self.stuck = 0

    async def start(
        self, fn: Callable[..., Any], *args: Any, wait_s: float
    ) -> concurrent.futures.Future[Any]:
        """``fn(*args)`` running in a free thread; NoFreeThread after ``wait_s``."""
        try:
            async with asyncio.timeout(wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise NoFreeThread(
                f"no {self.name} thread free for {wait_s:g} s "
                f"({self.stuck} of {self.max_threads} held by calls that timed out)"
            ) from None
        loop = asyncio.get_running_loop()
        future = self._pool.submit(fn, *args)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._slots.release))
        return future

    def let_go(self, future: concurrent.futures.Future[Any]) -> None:
        """The caller is done with ``future``: if it still runs, its thread is stuck."""
        if future.done():
            return
        self.stuck += 1
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._unstuck))

    def _unstuck(self) -> None:
        self.stuck -= 1

    def close(self) -> None:
        """Shut the pool down without waiting for calls still running."""
        self._pool.shutdown(wait=False, cancel_futures=True)
