"""``env_workers: N``: each episode's env in a worker process (rollout/env_workers.py),
its state kept there across the episode's calls; a worker that dies or hangs fails
only its own episodes. Driven by ``scripted_generate`` (tests/helpers/episodes.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.episodes import CHAT, decode, scripted_generate

from rlix_async.rollout.env_workers import EnvProcesses
from rlix_async.rollout.episodes import EnvFailure, EpisodeRunner, load_env

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)

ENV = """
import os, time
from rlix_async import StepResult


class Counter:
    def __init__(self, row):
        self.row, self.turns = row, 0

    def reset(self):
        return "count"

    async def step(self, action):
        self.turns += 1  # state kept in the worker across the episode's calls
        if self.row.get("die"):
            os._exit(3)
        if self.row.get("exit"):
            raise SystemExit(7)
        if self.row.get("hang"):
            time.sleep(20.0)
        return StepResult("more", 1.0, self.turns == 3, {"pid": os.getpid()})
"""


def runner(tmp_path: Path, workers: int, **limits: Any) -> EpisodeRunner:
    (tmp_path / "counter.py").write_text(ENV)
    spec = f"{tmp_path / 'counter.py'}:Counter"
    settings: dict[str, Any] = dict(
        max_turns=5, max_tokens=8, max_episode_tokens=400, step_timeout_s=30.0
    )
    settings.update(limits)
    processes = EnvProcesses(workers, spec, {})
    return EpisodeRunner(load_env(spec), CHAT, decode, processes=processes, **settings)


@pytest.mark.timeout(120)
async def test_an_episodes_env_lives_in_one_worker_process(tmp_path: Path) -> None:
    r = runner(tmp_path, 2)
    try:
        runs = [r.run({}, scripted_generate(["a", "b", "c"], [])) for _ in range(4)]
        eps = await asyncio.gather(*runs)  # at once: spread over the workers by load
    finally:
        r.close()
    assert all(e.turns == 3 and e.reward == 3.0 and e.cut == "" for e in eps)
    pids = {e.info["pid"] for e in eps}
    assert os.getpid() not in pids and len(pids) == 2  # spread over both workers


@pytest.mark.timeout(120)
async def test_a_workers_start_is_not_its_envs_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker process that takes longer to start than an env call may take (Python's
    start under load, a site hook) does not fail the first episode's ``__init__``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import time\ntime.sleep(2.5)\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = runner(tmp_path, 1, step_timeout_s=1.0)  # the worker starts spawning here
    try:
        ok = await r.run({}, scripted_generate(["a", "b", "c"], []))
        assert ok.turns == 3
    finally:
        r.close()


@pytest.mark.timeout(120)
async def test_a_worker_that_dies_or_hangs_fails_only_its_episodes(tmp_path: Path) -> None:
    r = runner(tmp_path, 2, step_timeout_s=3.0)
    assert r.processes is not None
    try:
        with pytest.raises(EnvFailure, match=r"step\(\) raised WorkerDied: env worker \d died"):
            await r.run({"die": True}, scripted_generate(["a"], []))
        ok = await r.run({}, scripted_generate(["a", "b", "c"], []))  # a new worker serves
        assert ok.turns == 3 and r.processes.replaced == 1
        # exit() in the env: that call's failure, in a worker that lives on
        with pytest.raises(EnvFailure, match=r"raised CalledExit: called exit\(7\)"):
            await r.run({"exit": True}, scripted_generate(["a"], []))
        assert r.processes.replaced == 1
        pids = [w.pid.result() for w in r.processes.workers]
        hung = asyncio.ensure_future(r.run({"hang": True}, scripted_generate(["a"], [])))
        await asyncio.sleep(0.3)  # the hanging episode holds worker 0; another runs beside
        other = await r.run({}, scripted_generate(["a", "b", "c"], []))
        with pytest.raises(EnvFailure, match=r"step\(\) took longer than 3 s"):
            await hung
        assert r.processes.replaced == 2  # its worker was stopped, and replaced
        assert other.turns == 3 and other.info["pid"] == pids[1]  # not the hung worker's
        after = await r.run({}, scripted_generate(["a", "b", "c"], []))
        assert after.turns == 3 and r.stuck == 0 and r.processes.load == [0, 0]
    finally:
        r.close()


@pytest.mark.timeout(120)
def test_closing_stops_a_worker_whose_call_never_returns(tmp_path: Path) -> None:
    """A hung env call must not hold the pipeline's exit (the pool's exit handler joins
    its workers): close() stops what is still running after its grace."""
    r = runner(tmp_path, 1, step_timeout_s=60.0)
    assert r.processes is not None
    processes = r.processes

    async def start() -> None:
        episode = asyncio.ensure_future(r.run({"hang": True}, scripted_generate(["a"], [])))
        await asyncio.sleep(1.0)  # in its step, in the worker
        episode.cancel()

    asyncio.run(start())
    t0 = time.monotonic()
    processes.close(grace_s=0.5)
    assert time.monotonic() - t0 < 3.0
    pid = processes.workers[0].pid.result()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie (exited, not yet reaped) is gone
        return fh.read().split()[2] != "Z"


@pytest.mark.timeout(120)
async def test_calls_queued_on_a_stopped_worker_fail_their_episodes_not_cancel_them(
    tmp_path: Path,
) -> None:
    """Stopping a hung worker cancels the calls queued behind it in its pool: each is
    that episode's WorkerDied, never a CancelledError that would leave the episode as
    if the pipeline had cancelled it (found by bench fuzz --target env)."""
    r = runner(tmp_path, 1, step_timeout_s=3.0)
    try:
        hung = asyncio.ensure_future(r.run({"hang": True}, scripted_generate(["a"], [])))
        await asyncio.sleep(0.5)  # its step runs; these queue behind it on the one worker
        queued = [r.run({}, scripted_generate(["a", "b", "c"], [])) for _ in range(4)]
        results = await asyncio.gather(hung, *queued, return_exceptions=True)
        assert all(isinstance(x, EnvFailure) for x in results), results
        assert sum("WorkerDied" in str(x) for x in results[1:]) >= 2
        ok = await r.run({}, scripted_generate(["a", "b", "c"], []))  # the new worker serves
        assert ok.turns == 3
    finally:
        r.close()
