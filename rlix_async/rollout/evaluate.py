"""Greedy evaluation of a text recipe on its pipeline's own shards, time-shared like rollout.

An evaluation decodes every prompt of the eval set greedily (temperature 0; an env
pipeline runs an episode per prompt, ``eval/truncated`` the share cut by a limit) on
weights of at least the version it evaluates, through the pipeline's router, and
scores each response with the recipe's reward. Its demand goes to the planner as
a progress stream of its own (``eval``: target = prompts, completed = answered),
summed with the rollout's, so the coordinator keeps (or wakes) shards for it as
it does for rollout, and it shares the cluster the same way. The result is a row
of ``eval/<metric>`` means. A prompt that fails is asked again after its pass
(``eval/retried`` counts the retries); one that fails every try scores 0
(``eval/failed``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from rlix_async.hooks import ClusterHooks
from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.episodes import Episode, EpisodeRunner
from rlix_async.rollout.prompts import Sample, TextPrompts, finite_mean, truncated
from rlix_async.shards.router import Trajectory

log = logging.getLogger("rlix_async.eval")
STREAM = "eval"
RETRIES = 2  # times a failed prompt is asked again (Evaluator.run)


def eval_due(step: int, every: int, last: int) -> bool:
    """Evaluate the weights of ``step`` (0: before the first step) every ``every`` steps,
    and those of the ``last`` step whatever the cadence: a run ends on a measurement."""
    return every > 0 and (step % every == 0 or step == last)


def summarize(
    rewards: list[float],
    extras: dict[str, list[float]],
    lengths: list[int],
    cut: list[bool],
    failed: int,
    reward_failed: int = 0,
) -> dict[str, float]:
    """``eval/<metric>`` means; a prompt that failed every try scores 0 (counted in
    eval/failed)."""
    n = len(rewards) + failed
    row = {
        "eval/reward": sum(rewards) / n if n else math.nan,
        "eval/n": float(n),
        "eval/failed": float(failed),
        "eval/reward_failed": float(reward_failed),
        "eval/response_tokens": sum(lengths) / len(lengths) if lengths else math.nan,
        "eval/truncated": sum(cut) / len(cut) if cut else math.nan,
    }
    for name, values in extras.items():  # the reward's extras, apart from the fields above
        row[f"eval/reward/{name}"] = finite_mean(values)
    return row


@dataclass
class _Scores:
    """What an evaluation's answered prompts add up to."""

    rewards: list[float] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)
    episode_figures: dict[str, list[float]] = field(default_factory=dict)  # turns, env info
    lengths: list[int] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward_failed: int = 0

    def add_episode(self, episode: Episode) -> None:  # an env's episode scored itself
        self.rewards.append(episode.reward)
        self.lengths.append(len(episode.token_ids))
        self.cut.append(bool(episode.cut))
        self.versions.extend(v for v in episode.versions if v is not None)
        self.episode_figures.setdefault("turns_mean", []).append(float(episode.turns))
        for name, value in episode.info.items():
            self.episode_figures.setdefault(f"env/{name}", []).append(value)


class Evaluator:
    def __init__(
        self,
        prompts: TextPrompts,
        hooks: ClusterHooks,
        *,
        max_tokens: int,
        concurrency: int = 32,
        timeout_s: float = 3600.0,
        episodes: EpisodeRunner | None = None,
        retries: int = RETRIES,
    ) -> None:
        self.prompts = prompts
        self.episodes = episodes  # an env pipeline's: each prompt is an episode
        self.hooks = hooks
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries

    async def run(self, version: int) -> dict[str, Any]:
        """Evaluate weights ``version`` (or newer, if the shards moved on meanwhile).

        A prompt whose request or episode failed is asked again after the rest of its
        pass, up to ``retries`` times: greedy decoding gives a healthy retry the answer
        the first try would have given, so a passing fault (an agent's own-time limit
        overrun on starved cores, a shard lost mid-turn) costs time, not score; a prompt
        that fails every time (an agent the model's answer breaks) scores 0, counted in
        ``eval/failed``, so breaking the scorer never pays."""
        t0 = time.monotonic()
        samples = [self.prompts.at(i) for i in range(len(self.prompts.dataset))]
        total, done = len(samples), 0
        client = self.hooks.client
        gate = asyncio.Semaphore(self.concurrency)
        scores = _Scores()
        pending, retried = samples, 0
        warned = False  # the first failure is logged; the rest are counted

        async def one(sample: Sample, last: bool) -> bool:
            nonlocal done, warned
            async with gate:  # generation and scoring: at most `concurrency` at once
                try:
                    traj = await self._generate(sample, version)
                except Exception as exc:  # one prompt's failure is counted, not fatal
                    if not last:
                        if not warned:
                            warned = True
                            log.warning("eval at version %d: %s (asked again)", version, exc)
                        return False
                    log.error("eval at version %d: a request failed every try: %s", version, exc)
                    traj = None
                if isinstance(traj, Episode):
                    scores.add_episode(traj)
                elif traj is not None:
                    await self._score(sample, traj, scores)
            done += 1
            await client.report_progress(total, done, STREAM)
            return traj is not None

        await client.report_progress(total, 0, STREAM, force=True)
        try:
            async with asyncio.timeout(self.timeout_s):
                for attempt in range(self.retries + 1):
                    last = attempt == self.retries
                    answered = await asyncio.gather(*(one(s, last) for s in pending))
                    pending = [s for s, ok in zip(pending, answered, strict=True) if not ok]
                    retried += len(pending) if not last else 0
                    if not pending:
                        break
        finally:
            await client.clear_progress(STREAM)
        return self._row(version, scores, failed=len(pending), retried=retried, t0=t0)

    async def _score(self, sample: Sample, traj: Trajectory, scores: _Scores) -> None:
        scored = await self.prompts.score(sample, [traj.token_ids])
        scores.rewards.append(scored.rewards[0])  # a failed reward scores 0 here
        scores.reward_failed += sum(scored.errors)
        for name, values in scored.extras.items():
            scores.extras.setdefault(name, []).append(values[0])
        scores.lengths.append(len(traj.token_ids))
        scores.cut.append(truncated(traj.token_ids, self.max_tokens, self.prompts.stop_token_ids))
        scores.versions.extend(v for v in traj.versions if v is not None)

    def _row(
        self, version: int, scores: _Scores, *, failed: int, retried: int, t0: float
    ) -> dict[str, Any]:
        s = scores
        row: dict[str, Any] = {"step": version}
        row.update(summarize(s.rewards, s.extras, s.lengths, s.cut, failed, s.reward_failed))
        row["eval/retried"] = float(retried)
        # an episode pipeline's: as its step rows have them (env/<info>, turns_mean)
        row.update({f"eval/{k}": finite_mean(v) for k, v in s.episode_figures.items()})
        # the weights it ran on: at least `version` (the shards may have moved on)
        row["eval/weight_version_min"] = min(s.versions, default=version)
        row["eval/weight_version_max"] = max(s.versions, default=version)
        row["eval_s"] = round(time.monotonic() - t0, 3)
        row["time"] = time.time()
        return row

    async def _generate(self, sample: Sample, version: int) -> Trajectory:
        greedy = Sampling(
            max_tokens=self.max_tokens,
            temperature=0.0,
            stop_token_ids=tuple(self.prompts.stop_token_ids),
            stop=tuple(self.prompts.stop),
        )
        if self.episodes is not None:
            row = self.prompts.env_row(sample)
            return await self.episodes.run(row, self.hooks.router.generate, greedy, version)
        return await self.hooks.router.generate(sample.ids, greedy, min_version=version)
