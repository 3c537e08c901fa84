"""One async GRPO pipeline: the torchrun entrypoint.

    torchrun --nproc-per-node N -m rlix_async.grpo.pipeline --config P.json [--resume]

Rank 0 drives: it joins the coordinator, collects trajectory groups through
the router into a replay buffer while it has rollout shards, and for each
step asks for its training devices (the coordinator shrinks the rollout
shards there), trains with every rank, builds the weight cache, releases the
devices and publishes the new version. The other ranks wait on the torchrun
store for each step's batch. The collective group exists only during a step.

Writes ``OUT/<id>/metrics.jsonl`` (one line per step) and checkpoints under
``OUT/<id>/ckpt``; ``--resume`` continues from the newest one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import pickle
import random
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rlix_async.control.topology import ClusterSpec
from rlix_async.grpo.algo import LossConfig
from rlix_async.grpo.buffer import Group, ReplayBuffer
from rlix_async.grpo.tasks import Task, make_task
from rlix_async.grpo.trainer import TorchTrainer, TrainerConfig, latest_checkpoint
from rlix_async.hooks import ClusterHooks, PipelineHooks
from rlix_async.shards.router import Trajectory

log = logging.getLogger("rlix_async.grpo")
STORE_TIMEOUT_S = 3600.0


class ClusterIn(msgspec.Struct, forbid_unknown_fields=True):
    tp: int = 1
    devices: list[int] = []


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    clusters: dict[str, ClusterIn]
    out: str = "rlix-out"
    coordinator: str | None = None  # endpoint; None = run alone (no cluster)
    keys: str | None = None  # CURVE key directory, required for tcp:// endpoints
    task: dict[str, Any] = msgspec.field(default_factory=lambda: {"name": "target_tokens"})
    steps: int = 10
    groups_per_step: int = 8  # prompts per training step
    group_size: int = 4  # responses per prompt
    max_tokens: int = 12
    temperature: float = 1.0
    max_trajectory_age_steps: int = 1
    max_groups_in_flight: int = 4
    loss: str = "dapo"
    backend: str = "torch"  # torch (HF Llama, DDP) | megatron (megatron-core GPTModel)
    lr: float = 2e-3
    seed: int = 0
    model: dict[str, int] = {}  # tiny random Llama config (see rlix_async/models/tiny.py)
    model_path: str | None = None  # or a HF checkpoint directory (trainer and shards)
    checkpoint_every: int = 1

    def topology(self) -> dict[str, ClusterSpec]:
        return {name: ClusterSpec(c.tp, tuple(c.devices)) for name, c in self.clusters.items()}


def load_config(path: str | Path) -> PipelineConfig:
    data = Path(path).read_bytes()
    try:
        return msgspec.json.decode(data, type=PipelineConfig)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"{path}: invalid pipeline config: {exc}") from None


def version_str(step: int) -> str:
    return f"s{step}"


def version_int(v: str | None) -> int:
    return int(v[1:]) if v and v.startswith("s") and v[1:].isdigit() else 0


class Driver:
    """Rank 0: collector + step loop."""

    def __init__(
        self, cfg: PipelineConfig, trainer: TorchTrainer, store: dist.Store | None
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.store = store
        self.task: Task = make_task(
            cfg.task["name"], **{k: v for k, v in cfg.task.items() if k != "name"}
        )
        self.rng = random.Random(cfg.seed)
        self.buffer = ReplayBuffer(cfg.max_trajectory_age_steps)
        self.out = Path(cfg.out) / cfg.id
        self.out.mkdir(parents=True, exist_ok=True)
        self.prompts_used = 0
        self.in_flight = 0
        self.failed = 0  # trajectories whose generation raised: counted, never hidden
        self.generated = 0
        self.resumed = 0
        # requests stopped unfinished because a finished sibling made their group too
        # old to train on (the group was bound to be dropped: why finish decoding it)
        self.cancelled_stale = 0
        self._groups: list[list[asyncio.Future[Trajectory]]] = []  # requests in flight
        self.hooks: PipelineHooks | None = None
        self._room = asyncio.Event()
        self.training = False  # a batch is taken and its step not yet published

    @property
    def target(self) -> int:
        return self.cfg.groups_per_step * self.cfg.group_size

    def resume_from(self, ckpt: dict[str, Any]) -> None:
        self.buffer = ReplayBuffer.from_state_dict(ckpt["buffer"])
        self.prompts_used = ckpt["prompts_used"]
        self.rng.setstate(ckpt["driver_rng"])
        self.generated = ckpt.get("generated", 0)
        self.failed = ckpt.get("failed", 0)
        self.cancelled_stale = ckpt.get("cancelled_stale", 0)

    async def run(self, cache: Any) -> None:
        from rlix_async.security import ClientKeys

        keys = ClientKeys.load(self.cfg.keys) if self.cfg.keys else None
        if not self.cfg.coordinator:
            raise SystemExit("a pipeline needs `coordinator` in its config")
        hooks = await ClusterHooks.join(
            self.cfg.coordinator, self.cfg.id, self.cfg.topology(), keys=keys
        )
        self.hooks = hooks
        try:
            await self._publish(cache)
            await hooks.report_progress(self.target, 0)
            collector = asyncio.ensure_future(self._collect())
            try:
                while self.trainer.step < self.cfg.steps:
                    await self._one_step(cache, collector)
            finally:
                collector.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collector
            await hooks.clear_progress()
        finally:
            await hooks.close()

    async def _publish(self, cache: Any) -> None:
        v = version_str(self.trainer.step)
        await asyncio.to_thread(cache.build, v, self.trainer.weights_for_cache())
        assert self.hooks is not None
        await self.hooks.after_training(self.trainer.step, cache.promote(v))

    async def _one_step(self, cache: Any, collector: asyncio.Future[None]) -> None:
        assert self.hooks is not None
        version = self.trainer.step
        while not self.buffer.ready(version, self.cfg.groups_per_step):
            if collector.done():
                collector.result()  # raises what killed it
                raise RuntimeError("collector stopped")
            if self.buffer.drop_stale(version):
                # what was collected is stale: the planner must see the demand again
                await self._report()
                self._room.set()
            await asyncio.sleep(0.05)
        batch = self.buffer.take(version, self.cfg.groups_per_step)
        self.training = True
        self._room.set()
        rewards = [r for g in batch for r in g.rewards]
        t0 = time.monotonic()
        await self.hooks.report_progress(self.target, self.target)
        await self.hooks.before_training(version)
        t1 = time.monotonic()
        if self.store is not None and self.trainer.world > 1:
            self.store.set(f"batch/{version}", pickle.dumps(batch))
        stats = await asyncio.to_thread(self._train, batch)
        step = self.trainer.step
        for group in self._groups:  # the step moved on: some groups can no longer be used
            self._stop_if_doomed(group)
        if step % self.cfg.checkpoint_every == 0 or step == self.cfg.steps:
            await asyncio.to_thread(self._save, self.out / "ckpt" / f"step_{step}.pt")
        await asyncio.to_thread(self.trainer.offload)  # never block heartbeats
        if step < self.cfg.steps:
            await self._publish(cache)
            self.training = False
            self._room.set()
            await self._report()
        else:  # the last step: no rollout will use these weights (the checkpoint has them),
            # and nothing more is collected (shards woken now would sync a cache that
            # is removed as the pipeline exits)
            await self.hooks.after_training(self.trainer.step, None)
        row = {
            "step": self.trainer.step,
            "reward": sum(rewards) / len(rewards),
            "trained_on_versions": sorted({g.oldest_version for g in batch}),
            "wait_s": round(t1 - t0, 3),
            "train_s": round(time.monotonic() - t1, 3),
            "generated": self.generated,
            "trained": self.buffer.trained,
            "dropped_stale": self.buffer.dropped_stale,
            "buffered": len(self.buffer),
            "failed": self.failed,
            "cancelled_stale": self.cancelled_stale,
            "resumed": self.resumed,
            "active_shards": len(self.hooks.client.active_ranks),
            "time": time.time(),
            **{k: round(v, 5) for k, v in stats.items()},
        }
        _append_jsonl(self.out / "metrics.jsonl", row)
        log.info("%s step %d reward %.3f", self.cfg.id, row["step"], row["reward"])

    async def _report(self) -> None:
        """Progress toward the next batch: fresh trajectories only (stale ones get dropped)."""
        assert self.hooks is not None
        done = min(self.buffer.fresh(self.trainer.step), self.target)
        await self.hooks.report_progress(self.target, done)

    def _train(self, batch: list[Group]) -> dict[str, float]:
        self.trainer.reload()
        self.trainer.init_group(self.store)
        try:
            return self.trainer.train_step(batch)
        finally:
            self.trainer.destroy_group()

    def _save(self, path: Path) -> None:
        self.trainer.save(
            path,
            {
                "buffer": self.buffer.state_dict(),
                "prompts_used": self.prompts_used,
                "driver_rng": self.rng.getstate(),
                "generated": self.generated,
                "failed": self.failed,
                "cancelled_stale": self.cancelled_stale,
            },
        )

    async def _collect(self) -> None:
        """Keep groups in flight while the buffer needs them and they cannot go stale."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                room = self.buffer.room(self.trainer.step, self.target, self.training)
                if self.trainer.step >= self.cfg.steps:
                    room = 0  # done: start nothing new
                if (
                    self.in_flight < self.cfg.max_groups_in_flight
                    and room > self.in_flight * self.cfg.group_size
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
        assert self.hooks is not None
        prompt = self.task.prompt(self.rng)
        self.prompts_used += 1
        # The oldest weights it may start on: still within the staleness bound at the
        # batch it will land in (the groups ahead of it fill the earlier ones, and
        # this step's batch is gone while it trains).
        queued = self.buffer.fresh(self.trainer.step) + (self.in_flight - 1) * self.cfg.group_size
        batch_ahead = queued // self.target + int(self.training)
        oldest = self.trainer.step + batch_ahead - self.cfg.max_trajectory_age_steps

        def accept_versions() -> list[str]:  # newer weights are always fine
            return [version_str(v) for v in range(max(oldest, 0), self.trainer.step + 1)]

        requests = [
            asyncio.ensure_future(
                self.hooks.router.generate(
                    prompt,
                    self.cfg.max_tokens,
                    temperature=self.cfg.temperature,
                    accept_versions=accept_versions,
                )
            )
            for _ in range(self.cfg.group_size)
        ]
        self._groups.append(requests)
        for r in requests:
            r.add_done_callback(lambda _: self._stop_if_doomed(requests))
        try:
            results = await asyncio.gather(*requests, return_exceptions=True)
            trajs = [r for r in results if not isinstance(r, BaseException)]
            cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    log.error("%s: a trajectory failed: %s", self.cfg.id, r)
            self.failed += len(results) - len(trajs) - cancelled
            self.generated += len(trajs)
            self.resumed += sum(1 for t in trajs if t.resumes)
            if cancelled:  # doomed: what finished is dropped as stale, nothing is trained
                self.cancelled_stale += cancelled
                self.buffer.add_stale(len(trajs))
                return
            if len(trajs) < 2:
                return
            group = Group(
                prompt=prompt,
                responses=[t.token_ids for t in trajs],
                logprobs=[t.logprobs for t in trajs],
                versions=[[version_int(v) for v in t.versions] for t in trajs],
                rewards=[self.task.score(prompt, t.token_ids) for t in trajs],
                resumes=sum(t.resumes for t in trajs),
            )
            self.buffer.add(group)
            await self._report()
        finally:
            self._groups.remove(requests)
            for r in requests:  # this task cancelled (shutdown): its requests end with it
                r.cancel()
            self.in_flight -= 1
            self._room.set()

    def _stop_if_doomed(self, requests: list[asyncio.Future[Trajectory]]) -> None:
        """Cancel a group's unfinished requests once a finished one is too old to train
        on at the current step: the whole group would be dropped, so stop decoding it
        (the router tells the shards) and let fresh groups have the slots."""
        finished = [
            r.result() for r in requests if r.done() and not r.cancelled() and not r.exception()
        ]
        oldest = min(
            (version_int(v) for t in finished for v in t.versions if v is not None), default=None
        )
        if oldest is None or not self.buffer.too_old(oldest, self.trainer.step):
            return
        for r in requests:
            r.cancel()


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def _follower(cfg: PipelineConfig, trainer: TorchTrainer, store: dist.Store) -> None:
    """Ranks > 0: train on each step's batch when rank 0 posts it."""
    while trainer.step < cfg.steps:
        key = f"batch/{trainer.step}"
        store.wait([key], timedelta(seconds=STORE_TIMEOUT_S))
        batch = pickle.loads(store.get(key))
        trainer.reload()
        trainer.init_group(store)
        try:
            trainer.train_step(batch)
        finally:
            trainer.destroy_group()
        trainer.offload()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlix_async.grpo.pipeline")
    ap.add_argument("--config", required=True, help="pipeline config JSON")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(args.config)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    store: dist.Store | None = None
    if world > 1:  # the torchrun agent's store outlives every per-step group
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
        )
    torch.manual_seed(cfg.seed)
    if cfg.backend not in ("torch", "megatron"):
        raise SystemExit(f"{args.config}: backend must be torch or megatron, not {cfg.backend!r}")
    trainer_cls: type[TorchTrainer] = TorchTrainer
    if cfg.backend == "megatron":
        from rlix_async.grpo.megatron_trainer import MegatronTrainer

        trainer_cls = MegatronTrainer
    trainer = trainer_cls(
        TrainerConfig(
            lr=cfg.lr,
            loss=LossConfig(cfg.loss),
            seed=cfg.seed,
            model=cfg.model or None,
            model_path=cfg.model_path,
        ),
        rank,
        world,
    )
    ckpt_dir = Path(cfg.out) / cfg.id / "ckpt"
    ckpt = None
    if args.resume and (path := latest_checkpoint(ckpt_dir)) is not None:
        ckpt = trainer.load(path)
        print(f"{cfg.id}: resumed from {path} (step {trainer.step})", flush=True)
    if rank != 0:
        assert store is not None
        _follower(cfg, trainer, store)
        return 0

    from rlix_async.aio import run
    from rlix_async.weights.cache import WeightCache

    driver = Driver(cfg, trainer, store)
    if ckpt is not None:
        driver.resume_from(ckpt)
    cache = WeightCache(cfg.id)
    try:
        run(driver.run(cache))
    finally:
        cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
