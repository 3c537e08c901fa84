"""``rlix-async bench fuzz --target env``: broken environments against the driver.

An environment is user code, run in ``env_workers`` processes that talk to the
driver over their pools' pipes. A broken one must fail its own episodes and never
the driver, whose event loop carries every other episode, the heartbeats and the
training. Each input is one episode through the real ``EpisodeRunner`` and
``EnvProcesses`` (two worker processes), whose env misbehaves in one way drawn at
random:

- ``garbage``: ``step`` returns something that is not a step (None, text, a dict, a
  tuple of the wrong length, a NaN or boolean reward, ``done`` that is no flag);
- ``raises``: ``step`` raises (ValueError, KeyError, RecursionError, MemoryError, ...);
- ``exits``: ``step`` calls ``sys.exit()``;
- ``dies``: the worker process ends (``os._exit``): its other episodes fail with it;
- ``hangs``: ``step`` sleeps past the step timeout: its worker is stopped, likewise,
  and calls queued behind it run out of time;
- ``unpicklable``: ``step`` returns what cannot cross the pipe;
- ``bad_reset``: ``reset`` returns no turn (None, a number, bytes, a list of non-messages);
- ``init_raises``: the env's constructor raises;
- ``huge``: a 64 KiB observation (the episode is cut at its token budget);
- ``good``: a well-behaved episode.

The model's turns come from a stand-in ``generate`` (a fixed answer): the fuzz is of
the env boundary, not of the engine. Episodes run 16 at a time. It passes when no
exception other than the runner's ``EnvFailure`` leaves an episode, no episode
outlives its bound, every hostile episode failed (``huge`` aside: cut), a good one
failed only beside a worker that died, was stopped or hung, the driver's loop never
ran a second of its own CPU time between two ticks of a 10 ms timer, nor stalled for
``LOOP_BLOCKED_S``, and afterwards a batch of good episodes all finish. How late the
timer fired at worst (``loop_lag_max_s``) is reported, not judged: on a busy host it
measures the host (1.14 s beside a full test run on 2 cores).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

KINDS = (
    "garbage", "raises", "exits", "dies", "hangs", "unpicklable", "bad_reset",
    "init_raises", "huge", "good",
)  # fmt: skip
# dies and hangs cost a worker process each (and its episodes; a hang its timeout too):
# drawn less often
WEIGHTS = (10, 10, 10, 2, 1, 10, 10, 10, 4, 20)
# A call's bound counts its time queued behind its worker's other calls and, on a new
# worker, the worker's start (a spawned interpreter importing the env: about a second
# here): under that, a replaced worker is stopped again before it serves anything.
STEP_TIMEOUT_S = 3.0
EPISODE_BOUND_S = 60.0  # far past any episode's own bounds: reaching it is a failure
CONCURRENCY = 16
FINAL_GOOD = 20
# a good episode on a worker that died or was stopped, or queued behind a hung call
COLLATERAL = ("WorkerDied", "was replaced", "took longer than")
# The loop's verdicts. Its CPU time between two ticks of the timer counts only what the
# loop thread itself ran (env code, a pickle, a tokenization on the loop): a busy host
# slows that down by a fraction, not tenfold, so a second of it is the loop's own doing.
LOOP_CPU_S = 1.0
# A stall off the CPU (the loop waiting in a system call, or for a core) is judged only
# between what host load makes of a 10 ms timer (about a second at worst on a loaded
# 2-core host) and what a loop that waited on env code reaches: a hanging env's step
# sleeps 30 s.
LOOP_BLOCKED_S = 10.0

HOSTILE_ENV = """
import math, os, random, sys, time
from rlix_async import StepResult

GARBAGE = [
    lambda r: None, lambda r: "done", lambda r: {"reward": 1.0}, lambda r: (1, 2),
    lambda r: ("obs", 1.0, True, {}, 5, 6), lambda r: StepResult("o", math.nan, True),
    lambda r: StepResult("o", True, True), lambda r: StepResult("o", 1.0, "maybe"),
    lambda r: StepResult("o", "1.0", True), lambda r: StepResult("o", math.inf, True),
    lambda r: [r.random()] * 3, lambda r: r.randbytes(16),
]
BAD_TURNS = [None, 42, b"bytes", [1, 2], [{"role": 7}], {"content": None}]
ERRORS = [ValueError, KeyError, RecursionError, MemoryError, ZeroDivisionError, OSError]


class Hostile:
    def __init__(self, row):
        self.kind, self.rng = row["kind"], random.Random(row["seed"])
        if self.kind == "init_raises":
            raise self.rng.choice(ERRORS)("no env for you")

    def reset(self):
        if self.kind == "bad_reset":
            return self.rng.choice(BAD_TURNS)
        return "What is 2 + 2?"

    def step(self, action):
        kind = self.kind
        if kind == "garbage":
            return self.rng.choice(GARBAGE)(self.rng)
        if kind == "raises":
            raise self.rng.choice(ERRORS)("broken env")
        if kind == "exits":
            sys.exit(self.rng.choice([0, 1, "bye"]))
        if kind == "dies":
            os._exit(self.rng.choice([0, 1, 137]))
        if kind == "hangs":
            time.sleep(30)
        if kind == "unpicklable":
            return StepResult("o", 1.0, True, {"f": lambda: 0})
        if kind == "huge":
            return StepResult("x" * 65536, 1.0, False)
        return StepResult("ok", 1.0, True)
"""


async def fuzz_env(tokenizer_dir: str, inputs: int, seed: int, workers: int = 2) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rlix_async.rollout.chat import ChatTurns
    from rlix_async.rollout.env_workers import EnvProcesses
    from rlix_async.rollout.episodes import EpisodeRunner, load_env

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kinds = random.Random(seed).choices(KINDS, WEIGHTS, k=inputs)
    with tempfile.TemporaryDirectory(prefix="rlix-fuzz-env-") as tmp:
        (Path(tmp) / "hostile.py").write_text(HOSTILE_ENV)
        spec = f"{Path(tmp) / 'hostile.py'}:Hostile"
        processes = EnvProcesses(workers, spec, {})
        runner = EpisodeRunner(
            load_env(spec), ChatTurns(tokenizer), _Fuzzer.decoder(tokenizer), max_turns=3,
            max_tokens=8, max_episode_tokens=256, step_timeout_s=STEP_TIMEOUT_S,
            processes=processes,
        )  # fmt: skip
        fuzz = _Fuzzer(runner, tokenizer)
        lag = _LoopLag()
        lag.start()
        started = time.perf_counter()
        try:
            await asyncio.gather(*(fuzz.one(k, n) for n, k in enumerate(kinds)))
            hostile_s = time.perf_counter() - started
            # the workers the storm replaced are up before the last batch: a call's 3 s
            # bound counts a new worker's start, which a busy host can stretch past it
            await asyncio.wait_for(
                asyncio.gather(
                    *(asyncio.wrap_future(w.pid) for w in processes.workers),
                    return_exceptions=True,
                ),
                EPISODE_BOUND_S,
            )
            before = fuzz.outcomes["good: finished (done)"]
            await asyncio.gather(*(fuzz.one("good", inputs + n) for n in range(FINAL_GOOD)))
            served = fuzz.outcomes["good: finished (done)"] - before
        finally:
            lag.stop()
            runner.close()
    if served != FINAL_GOOD:
        fuzz.bad.append(f"afterwards {served} of {FINAL_GOOD} good episodes finished")
    if lag.cpu_max_s >= LOOP_CPU_S:
        fuzz.bad.append(f"the driver's loop ran {lag.cpu_max_s:.2f} s of CPU in one go")
    if lag.max_s >= LOOP_BLOCKED_S:
        fuzz.bad.append(f"the driver's loop stalled {lag.max_s:.2f} s")
    return {
        "target": "env",
        "inputs": inputs,
        "kinds": dict(sorted(Counter(kinds).items())),
        "outcomes": dict(sorted(fuzz.outcomes.items())),
        "workers_replaced": processes.replaced,
        "loop_lag_max_s": round(lag.max_s, 3),
        "loop_cpu_max_s": round(lag.cpu_max_s, 3),
        "hostile_s": round(hostile_s, 2),
        "then_served": served,
        "problems": fuzz.bad[:20],
        "ok": not fuzz.bad,
    }


class _Fuzzer:
    """Runs episodes ``CONCURRENCY`` at a time and sorts how each ended."""

    def __init__(self, runner: Any, tokenizer: Any) -> None:
        self.runner = runner
        self.answer = list(tokenizer("4", add_special_tokens=False)["input_ids"])
        self.outcomes: Counter[str] = Counter()
        self.bad: list[str] = []  # what must not happen, described
        self.gate = asyncio.Semaphore(CONCURRENCY)

    @staticmethod
    def decoder(tokenizer: Any) -> Any:
        return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))

    async def generate(self, prompt_ids: list[int], sampling: Any, **_: Any) -> Any:
        """The model's stand-in: the same short answer every turn."""
        from rlix_async.shards.router import Trajectory

        out = self.answer[: sampling.max_tokens]
        return Trajectory(list(prompt_ids), out, [-1.0] * len(out), [0] * len(out))

    async def one(self, kind: str, n: int) -> None:
        from rlix_async.rollout.episodes import EnvFailure

        async with self.gate:
            try:
                episode = await asyncio.wait_for(
                    self.runner.run({"kind": kind, "seed": n}, self.generate), EPISODE_BOUND_S
                )
            except EnvFailure as exc:
                collateral = any(c in str(exc) for c in COLLATERAL)
                self.outcomes[f"{kind}: failed" + (" beside a lost worker" * collateral)] += 1
                if kind in ("good", "huge") and not collateral:
                    self.bad.append(f"{kind} episode failed: {exc}")
                return
            except TimeoutError:
                self.bad.append(f"{kind} episode still running after {EPISODE_BOUND_S:g} s")
                return
            except Exception as exc:  # escaped the runner: the fuzz's finding
                self.bad.append(f"{kind} episode raised {type(exc).__name__}: {exc}")
                return
            self.outcomes[f"{kind}: finished ({episode.cut or 'done'})"] += 1
            if kind not in ("good", "huge"):
                self.bad.append(f"{kind} episode finished ({episode.cut or 'done'})")


class _LoopLag:
    """How late a 10 ms sleep on the driver's loop wakes up, at worst, and the most CPU
    time the loop's thread spent between two ticks (it, not the host, decides that)."""

    def __init__(self) -> None:
        self.max_s = 0.0
        self.cpu_max_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._tick())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0, c0 = loop.time(), time.thread_time()
            await asyncio.sleep(0.01)
            self.max_s = max(self.max_s, loop.time() - t0 - 0.01)
            self.cpu_max_s = max(self.cpu_max_s, time.thread_time() - c0)
