"""Environments in worker processes: ``env_workers: N``, for CPU-heavy environments.

A plain env method runs in a thread of the driver process, and a CPU-bound one
holds the GIL while it runs: the driver's event loop (its heartbeats, every other
episode's turns) waits behind it. With ``env_workers: N`` each episode's env lives
in one of N worker processes (spawned, each a one-process pool) for its whole
episode, and every call (build, reset, step, close) runs there; ``async def``
methods run on that worker's own event loop, the same one for every call.
Arguments and results cross as pickles over the pools' pipes, between this process
and its own children only.

An episode goes to the least-loaded worker. A call past ``env_step_timeout_s`` (its
time queued behind the worker's other calls included) is cancelled if it has not
started; one that runs is stopped by killing its worker, which fails that worker's
other episodes too, and a new worker takes its place. A worker that dies the same
way fails only the episodes it held.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import multiprocessing
import os
import signal
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

_ENVS: dict[int, Any] = {}  # in a worker: its episodes' envs, by episode number
_LOOP: asyncio.AbstractEventLoop | None = None  # in a worker: its envs' event loop


def _in_worker(spec: str, env_args: dict[str, Any], episode: int, method: str, arg: Any) -> Any:
    """One env call, in a worker process (an exit() there is the call's failure)."""
    from rlix_async.user_code import call_guarded

    return call_guarded(_call_env, spec, env_args, episode, method, arg)


def _call_env(spec: str, env_args: dict[str, Any], episode: int, method: str, arg: Any) -> Any:
    global _LOOP
    if method == "__init__":
        from rlix_async.user_code import load_object

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
        if _LOOP is None:  # one loop for every call: an env's sessions and locks live on
            _LOOP = asyncio.new_event_loop()
        result = _LOOP.run_until_complete(_awaited(result))
    return result


async def _awaited(result: Any) -> Any:
    return await result


def _started() -> int:
    """A new worker's first task: what every env call imports, then its pid."""
    import rlix_async.user_code  # noqa: F401

    return os.getpid()


class WorkerDied(RuntimeError):
    """The worker process holding an episode's env is gone (or was stopped)."""


class _Worker:
    """One worker process: a one-process pool, and that process's pid once known."""

    def __init__(self, context: Any) -> None:
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
        self.pid = self.pool.submit(_started)  # to stop a call that will not return

    def kill(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.pid.done() and self.pid.exception() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid.result(), signal.SIGKILL)


class EnvProcesses:
    """N worker processes holding one env per episode."""

    def __init__(self, workers: int, spec: str, env_args: dict[str, Any]) -> None:
        self.spec, self.env_args = spec, dict(env_args)
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded driver
        self.workers = [_Worker(self._context) for _ in range(workers)]
        self.load = [0] * workers  # episodes on each
        self.replaced = 0  # workers killed or dead, and replaced
        self._where: dict[int, tuple[int, _Worker]] = {}
        self._numbers = itertools.count()
        self._closed = False

    async def started(self, timeout_s: float = 120.0) -> None:
        """Wait (``timeout_s`` at most) until every worker process has started and
        imported what env calls need: a replaced worker spawns afresh, which took over a
        second on a loaded CI machine, and that is not the env's time to be timed."""
        starting = [asyncio.wrap_future(w.pid) for w in self.workers if not w.pid.done()]
        for f in starting:  # a worker that died starting: its first call says so
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        if starting:
            await asyncio.wait(starting, timeout=timeout_s)

    async def build(self, row: dict[str, Any]) -> RemoteEnv:
        """A new episode's env, built in the least-loaded worker."""
        episode = next(self._numbers)
        index = min(range(len(self.workers)), key=lambda w: (self.load[w], w))
        self._where[episode] = (index, self.workers[index])
        self.load[index] += 1
        env = RemoteEnv(self, episode)
        try:
            await self.call(episode, "__init__", row)
        except BaseException:
            self.release(episode)
            raise
        return env

    async def call(self, episode: int, method: str, arg: Any = None) -> Any:
        index, worker = self._where[episode]
        if self.workers[index] is not worker:
            raise WorkerDied(f"env worker {index} was replaced, with this episode's env")
        try:
            future = worker.pool.submit(_in_worker, self.spec, self.env_args, episode, method, arg)
        except (BrokenProcessPool, RuntimeError):
            self._replace(index, worker)
            raise WorkerDied(f"env worker {index} died") from None
        waiting = asyncio.wrap_future(future)
        # read whatever it ends with, also after this call stopped waiting (a timeout):
        # never "exception never retrieved"
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(waiting)
        except BrokenProcessPool:
            self._replace(index, worker)
            raise WorkerDied(f"env worker {index} died during {method}()") from None
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this episode was cancelled
            # the call was queued on a worker that another episode's hang or death
            # stopped: that pool cancelled it (found by bench fuzz --target env)
            raise WorkerDied(f"env worker {index} was replaced before {method}() ran") from None
        finally:
            # timed out (or cancelled): a queued call is dropped; one that runs can only
            # be stopped with its process
            if not future.done() and not future.cancel():
                self._replace(index, worker)

    def _replace(self, index: int, worker: _Worker) -> None:
        if self.workers[index] is not worker or self._closed:
            return
        worker.kill()
        self.workers[index] = _Worker(self._context)
        self.replaced += 1

    def release(self, episode: int) -> None:
        """The episode is over: its env is closed in its worker, after the calls there."""
        index, worker = self._where.pop(episode, (None, None))
        if index is None or worker is None:
            return
        self.load[index] -= 1
        if self.workers[index] is worker and not self._closed:
            with contextlib.suppress(BrokenProcessPool, RuntimeError):  # gone, its envs too
                worker.pool.submit(_in_worker, self.spec, self.env_args, episode, "close", None)

    def close(self, grace_s: float = 5.0) -> None:
        """Let the workers run the closes they have queued, for ``grace_s`` at most, then
        stop them: a call that never returns must not hold the pipeline's exit."""
        self._closed = True
        markers = []
        for worker in self.workers:
            with contextlib.suppress(BrokenProcessPool, RuntimeError):
                markers.append(worker.pool.submit(os.getpid))  # done once the queue is
            worker.pool.shutdown(wait=False)
        deadline = time.monotonic() + grace_s
        for marker in markers:
            with contextlib.suppress(Exception):
                marker.result(timeout=max(deadline - time.monotonic(), 0.0))
        for worker in self.workers:
            worker.kill()


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
