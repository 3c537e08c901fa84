"""The collector: trajectory groups in flight while the buffer has room for them.

A group is ``group_size`` samples of one prompt (GRPO's unit). The collector
starts a group only when the replay buffer has room for it within the
staleness bound (``ReplayBuffer.room``), so what it generates can still be
trained on; every request names the oldest weights it may run on, and a group
whose finished sample has become too old is stopped (its shards stop decoding
it) instead of being decoded to the end and dropped. Every group it starts, and
how it came back, goes into the pipeline's ledger (``rollout/ledger.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rlix_async.config import PipelineConfig
from rlix_async.config.training import replays_routes
from rlix_async.control.pace import TrajectoryTimes, exclusive_step_s
from rlix_async.hooks import ClusterHooks
from rlix_async.protocols.batch import Group
from rlix_async.protocols.topology import INFER, TRAIN
from rlix_async.rollout.episodes import EnvFailure, Episode, EpisodeRunner, figures_of, pack
from rlix_async.rollout.ledger import Ledger
from rlix_async.rollout.prompts import (
    PromptSource,
    Sample,
    Scored,
    TextPrompts,
    make_token_prompts,
)
from rlix_async.shards.router import Trajectory
from rlix_async.train.buffer import ReplayBuffer

log = logging.getLogger("rlix_async.rollout")
# drop_uniform_groups resamples at most this many batches' worth of groups in a row
UNIFORM_LIMIT = 10


class EpisodesFailing(RuntimeError):
    """An episode pipeline's groups keep failing whole: one line, exit 1."""


class Collector:
    def __init__(
        self,
        cfg: PipelineConfig,
        buffer: ReplayBuffer,
        hooks: ClusterHooks,
        step: Callable[[], int],
        ledger: Ledger | None = None,
        prompts: PromptSource | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self.hooks = hooks
        self.step = step  # the trainer's current step: the newest weight version
        self.ledger = ledger
        # where prompts come from and how responses score: a text recipe's dataset and
        # reward, else the config's token-id task
        self.prompts: PromptSource = prompts or make_token_prompts(cfg)
        self.sampling = cfg.rollout.sampling(self.prompts.stop_token_ids)  # every request's
        # routing replay: keep the routes a shard returns (a base group's shard records
        # them for every member when one replays; the others leave them out)
        self.keeps_routes = replays_routes(cfg.train, cfg.model)
        self.prompts_used = 0
        self.in_flight = 0
        self.failed = 0  # trajectories whose generation raised: counted, never hidden
        self.generated = 0
        self.resumed = 0
        # requests stopped unfinished because a finished sibling made their group too
        # old to train on (the group was bound to be dropped: why finish decoding it)
        self.cancelled_stale = 0
        self.filtered = 0  # trajectories of groups dropped for equal rewards (drop_uniform_groups)
        self.uniform_in_a_row = 0  # groups filtered since the last one buffered
        self.reward_failed = 0  # trajectories left out because their reward failed
        self.env_failed = 0  # episodes whose environment raised, timed out or misbehaved
        self.failing_groups = 0  # episode groups in a row that came back without one episode
        self.fatal: EpisodesFailing | None = None  # what stops the run
        self.episodes = episodes  # an env pipeline's runner (None: one generate per sample)
        self.times = TrajectoryTimes()  # on shards, for the pace estimate (control/pace.py)
        self.training = False  # a batch is taken and its step not yet published
        self._groups: list[list[asyncio.Future[Trajectory]]] = []  # requests in flight
        self._room = asyncio.Event()

    @property
    def target(self) -> int:
        """Trajectories per training step."""
        return self.cfg.rollout.groups_per_step * self.cfg.rollout.group_size

    def set_training(self, training: bool) -> None:
        self.training = training
        self._room.set()

    def wake(self) -> None:
        """Re-check the room (the buffer changed)."""
        self._room.set()

    async def report(self) -> None:
        """Progress toward the next batch: fresh trajectories only (stale ones get dropped)."""
        done = min(self.buffer.fresh(self.step()), self.target)
        await self.hooks.report_progress(self.target, done)

    async def report_pace(self, train_s: float) -> float | None:
        """After a step: our step alone on every declared device, estimated from the
        trajectories' times on shards and this step's training (control/pace.py), to
        the coordinator (finish-time fairness reads our slowdown against it), and
        returned. None before a trajectory finished, or without a rollout cluster."""
        clusters = self.hooks.client.clusters
        infer, train = clusters.get(INFER), clusters.get(TRAIN)
        if infer is None or not self.times.count:
            return None
        mean, longest = self.times.step_done(0.0)
        rollout = self.cfg.rollout
        capacity = rollout.max_groups_in_flight * rollout.group_size
        free = infer.ranks_clear_of(train.devices if train is not None else ())
        alone = exclusive_step_s(
            train_s=train_s,
            trajectory_mean_s=mean,
            trajectory_longest_s=longest,
            target=self.target,
            capacity=capacity,
            capacity_training=capacity * free // infer.dp,
            staleness=self.buffer.bound.max_steps,
        )
        await self.hooks.report_pace(alone)
        return alone

    def stop_doomed(self) -> None:
        """After a step: groups the new step made too old are stopped."""
        for group in self._groups:
            self._stop_if_doomed(group)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts_used": self.prompts_used,
            **self.prompts.state_dict(),
            "generated": self.generated,
            "failed": self.failed,
            "cancelled_stale": self.cancelled_stale,
            "filtered": self.filtered,
            "reward_failed": self.reward_failed,
            "env_failed": self.env_failed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts_used = state["prompts_used"]
        self.prompts.load_state_dict(state)
        self.generated = state.get("generated", 0)
        self.failed = state.get("failed", 0)
        self.cancelled_stale = state.get("cancelled_stale", 0)
        self.filtered = state.get("filtered", 0)
        self.reward_failed = state.get("reward_failed", 0)
        self.env_failed = state.get("env_failed", 0)

    async def run(self) -> None:
        """Keep groups in flight while the buffer needs them and they cannot go stale;
        EpisodesFailing once groups keep coming back without one good episode."""
        tasks: set[asyncio.Task[None]] = set()
        group_size = self.cfg.rollout.group_size
        try:
            while True:
                if self.fatal is not None:
                    raise self.fatal
                room = self.buffer.room(self.step(), self.target, self.training)
                if self.step() >= self.cfg.steps:
                    room = 0  # done: start nothing new
                if (
                    self.in_flight < self.cfg.rollout.max_groups_in_flight
                    and room > self.in_flight * group_size
                ):
                    self.in_flight += 1
                    t = asyncio.ensure_future(self._one_group())
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    continue
                self._room.clear()
                # asyncio.timeout, not wait_for: wait_for swallows a cancel that lands
                # as the event fires (3.11), and this loop would then run forever
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._room.wait()
        finally:
            for t in tasks:
                t.cancel()

    async def _one_group(self) -> None:
        rollout = self.cfg.rollout
        sample = self.prompts.next()
        self.prompts_used += 1
        # The oldest weights it may start on: still within the staleness bound at the
        # batch it will land in (the groups ahead of it fill the earlier ones, and
        # this step's batch is gone while it trains).
        step = self.step()
        queued = self.buffer.fresh(step) + (self.in_flight - 1) * rollout.group_size
        batch_ahead = queued // self.target + int(self.training)
        oldest = self.buffer.bound.oldest_usable(step + batch_ahead)
        gid = self.ledger.new_id() if self.ledger is not None else ""
        if self.ledger is not None:  # before any request leaves: a kill now still counts it
            self.ledger.requested(gid, rollout.group_size, step, sample.index)
        requests: list[asyncio.Future[Trajectory]] = [
            asyncio.ensure_future(self._request(sample, oldest))  # newer weights are fine
            for _ in range(rollout.group_size)
        ]
        self._groups.append(requests)
        for r in requests:
            r.add_done_callback(lambda _: self._stop_if_doomed(requests))
        try:
            results = await asyncio.gather(*requests, return_exceptions=True)
            if await self._add(sample, results, gid):
                await self.report()
        finally:
            self._groups.remove(requests)
            self.prompts.settle(sample)  # its row is no longer in flight (data order)
            for r in requests:  # this task cancelled (shutdown): its requests end with it
                r.cancel()
            self.in_flight -= 1
            self._room.set()

    async def _add(
        self, sample: Sample, results: list[Trajectory | BaseException], gid: str
    ) -> bool:
        """Count a finished group, score and buffer it (or count it dropped, if it was
        doomed); True when it was buffered."""
        trajs, cancelled, failed = self._count(results)
        self._watch_failures(trajs, cancelled)
        # doomed: what finished is dropped as stale, nothing is trained; fewer than two
        # answers: no advantage to compute, the group is discarded (lost work)
        outcome = "stale" if cancelled else "unusable" if len(trajs) < 2 else None
        if outcome is not None:
            if self.ledger is not None:
                self.ledger.finished(gid, len(trajs), failed, cancelled, outcome)
            if outcome == "stale":
                self.cancelled_stale += cancelled
                self.buffer.add_stale(len(trajs))
            return False
        kept, scored = await self._score(sample, trajs)
        reward_failed = len(trajs) - len(kept)
        failed += reward_failed
        trajs = [trajs[i] for i in kept]
        rewards = [scored.rewards[i] for i in kept]
        outcome = self._verdict(rewards)
        if self.ledger is not None:
            self.ledger.finished(gid, len(trajs), failed, cancelled, outcome)
        if outcome == "filtered":
            self.filtered += len(trajs)
            self._room.set()
        if outcome != "buffered":
            return False
        texts = [scored.texts[i] for i in kept] if scored.texts else []
        extras = {k: [v[i] for i in kept] for k, v in scored.extras.items()}
        self.buffer.add(self._group(sample, trajs, rewards, texts, extras, gid))
        return True

    def _watch_failures(self, trajs: list[Trajectory], cancelled: int) -> None:
        """An episode pipeline whose groups keep failing whole stops (``fail_after_groups``
        in a row without one good episode): nothing would ever train."""
        if self.episodes is None or cancelled:
            return
        self.failing_groups = 0 if trajs else self.failing_groups + 1
        if self.failing_groups >= self.cfg.env.fail_after_groups and self.fatal is None:
            self.fatal = EpisodesFailing(
                f"{self.cfg.id}: {self.failing_groups} groups in a row without one good "
                f"episode (fail_after_groups); the first failure: "
                f"{self.episodes.first_failure or 'a failed request'}"
            )

    def _count(
        self, results: list[Trajectory | BaseException]
    ) -> tuple[list[Trajectory], int, int]:
        """A group's answers, how many were cancelled and how many failed (counted, the
        failures logged; an env's are logged by its episode runner, with the row)."""
        trajs = [r for r in results if not isinstance(r, BaseException)]
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        for r in results:
            if isinstance(r, EnvFailure):
                self.env_failed += 1
            elif isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.error("%s: a trajectory failed: %s", self.cfg.id, r)
        failed = len(results) - len(trajs) - cancelled
        self.failed += failed
        self.generated += len(trajs)
        self.resumed += sum(1 for t in trajs if t.resumes)
        for t in trajs:  # an episode waits for its environment too, alone or not
            self.times.add(t.served_s + (t.env_s if isinstance(t, Episode) else 0.0))
        return trajs, cancelled, failed

    async def _score(self, sample: Sample, trajs: list[Trajectory]) -> tuple[list[int], Scored]:
        """The answers' scores, and which of them to keep: a response whose reward failed
        (raised, timed out, not finite) is counted and left out, since a 0 there would
        be a verdict the reward never gave. An env's episodes scored themselves."""
        episodes = [t for t in trajs if isinstance(t, Episode)]
        if episodes and len(episodes) == len(trajs):
            texts = [self._text(e.token_ids) for e in episodes]
            scored = Scored([e.reward for e in episodes], texts, {}, [False] * len(episodes))
        else:
            scored = await self.prompts.score(sample, [t.token_ids for t in trajs])
        kept = [i for i, error in enumerate(scored.errors) if not error]
        self.reward_failed += len(trajs) - len(kept)
        return kept, scored

    def _verdict(self, rewards: list[float]) -> str:
        """What becomes of a scored group: buffered, unusable (fewer than two answers)
        or filtered (DAPO's dynamic sampling: every answer scored alike, no advantage,
        no gradient; another prompt takes its room). Bounded: after many in a row (the
        policy solves, or fails, everything) they are trained on, with a warning."""
        if len(rewards) < 2:
            return "unusable"
        if self.cfg.rollout.drop_uniform_groups and len(set(rewards)) == 1:
            self.uniform_in_a_row += 1
            limit = UNIFORM_LIMIT * self.cfg.rollout.groups_per_step
            if self.uniform_in_a_row <= limit:
                return "filtered"
            if self.uniform_in_a_row == limit + 1:
                log.warning(
                    "%s: %d groups in a row scored alike; training on them (no gradient) "
                    "instead of resampling forever",
                    self.cfg.id,
                    self.uniform_in_a_row - 1,
                )
        self.uniform_in_a_row = 0  # buffered: a run of alike groups starts again
        return "buffered"

    def _group(
        self,
        sample: Sample,
        trajs: list[Trajectory],
        rewards: list[float],
        texts: list[str],
        extras: dict[str, list[float]],
        gid: str,
    ) -> Group:
        """The replay buffer's group: an env's episodes packed under one prompt (the
        env's first turn, as rendered: special tokens too), else the sample's."""
        episodes = [t for t in trajs if isinstance(t, Episode)]
        members: list[int] = []
        routes: list[bytes] = []
        if any(e.segments for e in episodes):  # agent_api: an episode split in several
            members = [i for i, e in enumerate(episodes) for _ in range(len(e.segments) + 1)]
            episodes = [s for e in episodes for s in (*e.segments, e)]
            rewards = [rewards[i] for i in members]
            texts = [self._text(e.token_ids) for e in episodes] if texts else []
            extras = {k: [v[i] for i in members] for k, v in extras.items()}
        if episodes:  # (all kept: an episode's score never fails)
            packed = pack(episodes)
            prompt = packed.prompt
            tokenizer = getattr(self.prompts, "tokenizer", None)
            prompt_text = str(tokenizer.decode(prompt)) if tokenizer is not None else ""
            responses, logprobs, versions = packed.responses, packed.logprobs, packed.versions
        else:
            prompt, prompt_text = sample.ids, sample.text
            responses, logprobs = [t.token_ids for t in trajs], [t.logprobs for t in trajs]
            versions = [[0 if v is None else v for v in t.versions] for t in trajs]
            # routing replay: plain generations only (an episode's turns' routes are not
            # joined into the episode's yet)
            if self.keeps_routes and any(t.routes for t in trajs):
                routes = [t.routes for t in trajs]
        return Group(
            prompt=prompt,
            responses=responses,
            logprobs=logprobs,
            versions=versions,
            rewards=rewards,
            resumes=sum(t.resumes for t in (episodes if members else trajs)),
            id=gid,
            prompt_text=prompt_text,
            response_texts=texts,
            reward_extras=extras,
            masks=packed.masks if episodes else [],
            episodes=figures_of(episodes) if episodes else {},
            members=members,
            routes=routes,
        )

    def _request(self, sample: Sample, min_version: int) -> Awaitable[Trajectory]:
        """One response: a generate call, or an episode of the env's (several turns)."""
        generate, sampling = self.hooks.router.generate, self.sampling
        if self.episodes is not None and isinstance(self.prompts, TextPrompts):
            row = self.prompts.env_row(sample)
            return self.episodes.run(row, generate, sampling, min_version)
        return generate(sample.ids, sampling, min_version=min_version)

    def _text(self, tokens: list[int]) -> str:
        decode = getattr(self.prompts, "decode", None)
        return decode(tokens) if decode is not None else ""

    def _stop_if_doomed(self, requests: list[asyncio.Future[Trajectory]]) -> None:
        """Cancel a group's unfinished requests once a finished one is too old to train
        on at the current step: the whole group would be dropped, so stop decoding it
        (the router tells the shards) and let fresh groups have the slots."""
        finished = [
            r.result() for r in requests if r.done() and not r.cancelled() and not r.exception()
        ]
        oldest = min(
            (v for t in finished for v in t.versions if v is not None),
            default=None,
        )
        if oldest is None or not self.buffer.bound.too_old(oldest, self.step()):
            return
        for r in requests:
            r.cancel()
