"""Environments in worker processes: ``env_workers: N``, for CPU-heavy environments.

A plain env method runs in a thread of the driver process, and a CPU-bound one
holds the GIL while it runs: the driver's event loop (its heartbeats, every other
episode's turns) waits behind it. With ``env_workers: N`` each episode's env lives
in one of N worker processes (spawned, each a one-process pool) for its whole
episode, and every call (build, reset, step, close) runs there: ``async def``
methods in an event loop of that call's own. Arguments and results cross as
pickles over the pools' pipes, between this process and its own children only.

An episode goes to the least-loaded worker that is not stuck (a call that timed
out and still runs there). A worker that dies fails the calls it had; its pool is
replaced for the episodes after.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import multiprocessing
from concurrent.futures.process import BrokenProcessPool
from typing import Any

_ENVS: dict[int, Any] = {}  # in a worker: its episodes' envs, by episode number


def _in_worker(spec: str, env_args: dict[str, Any], episode: int, method: str, arg: Any) -> Any:
    """One env call, in a worker process."""
    if method == "__init__":
        from rlix_async.loading import load_object

        _ENVS[episode] = load_object(spec)(arg, **env_args)
        return None
    if method == "close":
        env = _ENVS.pop(episode, None)
        close = getattr(env, "close", None)
        result = close() if callable(close) else None
    else:
        fn = getattr(_ENVS[episode], method)
        result = fn() if method == "reset" else fn(arg)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(result: Any) -> Any:
    return await result


class EnvProcesses:
    """N worker processes holding one env per episode."""

    def __init__(self, workers: int, spec: str, env_args: dict[str, Any]) -> None:
        self.spec, self.env_args = spec, dict(env_args)
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded driver
        self.pools = [self._pool() for _ in range(workers)]
        self.load = [0] * workers  # episodes on each
        self.stuck = [0] * workers  # calls that timed out and still run there
        self._where: dict[int, int] = {}
        self._numbers = itertools.count()

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(1, mp_context=self._context)

    async def build(self, row: dict[str, Any]) -> RemoteEnv:
        """A new episode's env, built in the least-loaded worker that is not stuck."""
        episode = next(self._numbers)
        worker = min(range(len(self.pools)), key=lambda w: (self.stuck[w] > 0, self.load[w], w))
        self._where[episode] = worker
        self.load[worker] += 1
        env = RemoteEnv(self, episode)
        try:
            await self.call(episode, "__init__", row)
        except BaseException:
            self.release(episode)
            raise
        return env

    async def call(self, episode: int, method: str, arg: Any = None) -> Any:
        worker = self._where[episode]
        pool = self.pools[worker]
        try:
            future = pool.submit(_in_worker, self.spec, self.env_args, episode, method, arg)
        except BrokenProcessPool:
            self.pools[worker] = self._pool()  # a dead worker: a new one for later episodes
            raise RuntimeError(f"env worker {worker} died") from None
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except BrokenProcessPool:
            if self.pools[worker] is pool:
                self.pools[worker] = self._pool()
            raise RuntimeError(f"env worker {worker} died during {method}()") from None
        finally:
            if not future.done():  # timed out (or cancelled) while it runs there
                self.stuck[worker] += 1
                loop = asyncio.get_running_loop()
                future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._unstuck, worker))

    def _unstuck(self, worker: int) -> None:
        self.stuck[worker] -= 1

    def release(self, episode: int) -> None:
        """The episode is over: its env is closed there when its worker gets to it."""
        worker = self._where.pop(episode, None)
        if worker is None:
            return
        self.load[worker] -= 1
        with contextlib.suppress(BrokenProcessPool):  # a dead worker took its envs along
            self.pools[worker].submit(_in_worker, self.spec, self.env_args, episode, "close", None)

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)


class RemoteEnv:
    """An env in a worker process, as the episode runner sees it (async methods)."""

    def __init__(self, processes: EnvProcesses, episode: int) -> None:
        self.processes, self.episode = processes, episode

    async def reset(self) -> Any:
        return await self.processes.call(self.episode, "reset")

    async def step(self, action: str) -> Any:
        return await self.processes.call(self.episode, "step", action)

    def release(self) -> None:
        self.processes.release(self.episode)
