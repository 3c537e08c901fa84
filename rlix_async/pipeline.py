"""The pipeline process: one async GRPO pipeline, launched by torchrun.

    torchrun --nproc-per-node N -m rlix_async.pipeline --config P.yaml [--resume] [KEY=VALUE ...]

Rank 0 drives: it joins the coordinator, runs the collector (trajectory
groups through the router into the replay buffer) while it has rollout
shards, and for each step asks for its training devices (the coordinator
shrinks the rollout shards there), trains with every rank, builds the weight
cache, releases the devices and publishes the new version. The other ranks
receive each step's batch through rank 0's loopback store (``train/rendezvous.py``,
``train/batches.py``:
msgpack, never pickle; no wait without a bound). The collective group exists
only during a step.

A text recipe (``data`` and ``reward``: ``rollout/prompts.py``) is loaded by rank 0
before it joins; its greedy evaluations (``eval_every``) run beside the collector
on the pipeline's shards (``rollout/evaluate.py``).

Writes ``OUT/<id>/metrics.jsonl`` (one line per step, and one per evaluation with
its ``eval/...`` keys), ``OUT/<id>/samples.jsonl`` (a few trajectories per step as
text, for text recipes), the trajectory ledger
``OUT/<id>/ledger.jsonl`` (``rollout/ledger.py``: what was asked for and what
became of it, across restarts) and checkpoints under ``OUT/<id>/ckpt``;
``--resume`` continues from the newest one.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import ConfigError, PipelineConfig, load_config
from rlix_async.hooks import ClusterHooks
from rlix_async.observe.loggers import flush_at_exit
from rlix_async.protocols.batch import Group
from rlix_async.protocols.topology import SPAN_ADDRESS, SPAN_FIRST_RANK, SPAN_WORLD
from rlix_async.protocols.trainer import Trainer
from rlix_async.rollout.collector import Collector, EpisodesFailing
from rlix_async.rollout.evaluate import Evaluator, eval_due
from rlix_async.rollout.ledger import LEDGER, Ledger
from rlix_async.rollout.prompts import Recipe, RecipeError, load_recipe
from rlix_async.rollout.records import RunRecords
from rlix_async.train.backends import TrainerBackendError, build_trainer
from rlix_async.train.batches import BatchChannel, RankGone
from rlix_async.train.buffer import ReplayBuffer, StalenessBound
from rlix_async.train.checkpoints import (
    checkpoint_due,
    checkpoint_path,
    latest_checkpoint,
    prune_checkpoints,
    same_resume_step,
)
from rlix_async.train.rendezvous import (
    RendezvousError,
    forget,
    meet,
    meet_across,
    pin_links_to,
    pin_links_to_loopback,
    trainer_store_secret,
)
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.delta_source import VersionDeltas, WireRows
from rlix_async.weights.tcp import WeightServer

log = logging.getLogger("rlix_async.pipeline")
# bounds any blocking call on the ranks' store (the per-step groups' rendezvous);
# the batch hand-over polls instead, with bounds of its own (train/batches.py)
STORE_TIMEOUT_S = 3600.0


TRAINER_THREAD = "trainer"  # the name of the thread every trainer call runs on


class Driver:
    """Rank 0: the collector and the step loop."""

    def __init__(
        self,
        cfg: PipelineConfig,
        trainer: Trainer,
        store: dist.Store | None,
        ckpt: dict[str, Any] | None = None,
        *,
        channel: BatchChannel | None = None,
        resumed: bool = False,
        recipe: Recipe | None = None,
    ) -> None:
        self.cfg = cfg
        self.recipe = recipe  # a text recipe's tokenizer, data and reward (None: token task)
        self._evals: asyncio.Future[None] | None = None  # the evaluations, one after another
        self._eval_next: int | None = None  # the version due next, while one runs
        self.trainer = trainer
        self.store = store
        self.channel = channel  # to the other ranks (None: running alone)
        self.sync_bytes = 0  # the bytes of the last version published (metrics.jsonl)
        # with a weight server: each version encoded against the last, for other nodes
        self.deltas: VersionDeltas | None = None
        self.wire_rows: WireRows | None = None  # with a weight server: what it sent
        self._train_times: dict[str, float] = {}  # the last step's reload and group times
        self.ckpt = ckpt  # the checkpoint resumed from: buffer and collector state
        self.resumed = resumed  # --resume (with or without a checkpoint to resume from)
        bound = StalenessBound(cfg.max_trajectory_age_steps)  # the config's, resumed or not
        self.buffer = (
            ReplayBuffer.from_state_dict(ckpt["buffer"], bound)
            if ckpt is not None
            else ReplayBuffer(bound)
        )
        self.out = cfg.run_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.records = RunRecords(cfg, recipe)  # metrics.jsonl, samples.jsonl, loggers
        # Every call that allocates the trainer's tensors runs on this one thread. glibc
        # gives each thread that allocates its own arena and keeps what a step frees
        # there: spread over the default executor's threads, the agent recipe's trainer
        # held 7 GB for a 3.4 GB working set (docs/PERF.md, issue 49).
        self._trainer_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=TRAINER_THREAD
        )

    async def _on_trainer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, fn, *args)

    async def run(self, cache: WeightCache) -> None:
        from rlix_async.security import ClientKeys

        if not self.cfg.coordinator:
            raise ValueError(f"pipeline {self.cfg.id}: no coordinator endpoint in its config")
        key_name, keys = (  # this pipeline's own driver key, else the shared client key
            ClientKeys.load_first(self.cfg.keys, f"driver-{self.cfg.id}", "client")
            if self.cfg.keys
            else ("", None)
        )
        weight_server: WeightServer | None = None
        # a resume that found no checkpoint starts at step 0 but is not a new run: what
        # the killed process did is lost, and the ledger must say so
        ledger = Ledger(
            self.out / LEDGER,
            fresh=not self.resumed,
            from_step=self.trainer.step,
            buffered=list(self.buffer.groups),
        )
        self.buffer.on_drop = ledger.dropped
        self.records.open_loggers()
        try:
            weight_server = await self._serve_weights(cache, key_name)
            hooks = await ClusterHooks.join(
                self.cfg.coordinator,
                self.cfg.id,
                self.cfg.clusters,
                keys=keys,
                weight=self.cfg.weight,
                group=self.cfg.base_group,
            )
            prompts = self.recipe.train_prompts(self.cfg) if self.recipe is not None else None
            episodes = self.recipe.episodes if self.recipe is not None else None
            collector = Collector(
                self.cfg, self.buffer, hooks, lambda: self.trainer.step, ledger, prompts, episodes
            )
            self.collector = collector
            evaluator = self._evaluator(hooks)
            if self.ckpt is not None:
                collector.load_state_dict(self.ckpt)
            try:
                await self._build(cache)  # the starting weights (the trainer starts offloaded)
                await self._publish(hooks, cache)
                self._maybe_eval(evaluator, self.trainer.step)
                await hooks.report_progress(collector.target, 0)
                collecting = asyncio.ensure_future(collector.run())
                try:
                    while self.trainer.step < self.cfg.steps:
                        await self._one_step(hooks, cache, collector, collecting, ledger)
                        self._maybe_eval(evaluator, self.trainer.step)
                    if self._evals is not None:  # the last evaluation's row, before leaving
                        await self._evals
                finally:
                    for task in (collecting, self._evals):
                        if task is not None and not task.done():  # a failure: stop them
                            task.cancel()
                            with contextlib.suppress(asyncio.CancelledError):
                                await task
                ledger.end(self.trainer.step)  # what is still buffered or in flight: left over
                await hooks.clear_progress()
            finally:
                await hooks.close()
        finally:
            ledger.close()
            self.records.close()
            self._trainer_thread.shutdown(wait=False)  # idle unless a failure left a call
            if self.deltas is not None:  # before the cache closes: it would wait for it
                self.deltas.stop()
            if weight_server is not None:
                await weight_server.close()

    async def _serve_weights(self, cache: WeightCache, key_name: str) -> WeightServer | None:
        """With ``weights_endpoint``: serve the cache to shards on other nodes, with this
        driver's own key pair (its public key travels in every published ref)."""
        endpoint = self.cfg.weights_endpoint
        if endpoint is None:
            return None
        from rlix_async.security import ServerKeys

        keys = ServerKeys.load(self.cfg.keys, key_name) if self.cfg.keys else None
        if self.cfg.weights.delta != "off":
            self.deltas = VersionDeltas(cache, self.cfg.weights.delta)
        server = await WeightServer(
            cache, endpoint, keys=keys, streams=self.cfg.weights.streams, deltas=self.deltas
        ).start()
        self.wire_rows = WireRows(server.streamer, self.deltas)
        public = keys.public.decode() if keys is not None else ""
        cache.serve(server.endpoint, public, self.cfg.weights.transport)
        log.info("%s: serving weights at %s", self.cfg.id, server.endpoint)
        return server

    async def _build(self, cache: WeightCache) -> None:
        """This step's weights into the cache, while they are still on the device: on
        CUDA each tensor goes straight from the device into the page-locked slot (one
        DMA per tensor, no host temporary), instead of offload first and a host copy
        after (docs/PERF.md, "GPU figures")."""
        await self._on_trainer_thread(self._build_on_trainer_thread, cache)

    def _build_on_trainer_thread(self, cache: WeightCache) -> None:
        tensors = self.trainer.weights_for_cache()  # a LoRA pipeline's: its adapter only
        self.sync_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.deltas is not None:  # the last version's encoding: ended at its next bucket
            self.deltas.stop()
        cache.build(self.trainer.step, tensors)
        if self.deltas is not None:  # in a thread of its own: the next step goes on
            self.deltas.encode(self.trainer.step)

    async def _publish(self, hooks: ClusterHooks, cache: WeightCache) -> None:
        v = self.trainer.step
        await hooks.after_training(v, cache.promote(v))

    async def _wait_for_batch(self, collector: Collector, collecting: asyncio.Future[None]) -> None:
        version = self.trainer.step
        while not self.buffer.ready(version, self.cfg.rollout.groups_per_step):
            if collecting.done():
                collecting.result()  # raises what killed it
                raise RuntimeError("collector stopped")
            if self.buffer.drop_stale(version):
                # what was collected is stale: the planner must see the demand again
                await collector.report()
                collector.wake()
            await asyncio.sleep(0.05)

    async def _one_step(
        self,
        hooks: ClusterHooks,
        cache: WeightCache,
        collector: Collector,
        collecting: asyncio.Future[None],
        ledger: Ledger,
    ) -> None:
        await self._wait_for_batch(collector, collecting)
        version = self.trainer.step
        batch = self.buffer.take(version, self.cfg.rollout.groups_per_step)
        ledger.taken(batch, version)
        collector.set_training(True)
        t0 = time.monotonic()
        await hooks.report_progress(collector.target, collector.target)
        await hooks.before_training(version)
        t1 = time.monotonic()
        if self.channel is not None:
            await asyncio.to_thread(self.channel.post, version, batch)
        stats: dict[str, float] = await self._on_trainer_thread(self._train, batch)
        collector.stop_doomed()  # the step moved on: some groups can no longer be used
        times = await self._after_training(hooks, cache, collector, ledger, version)
        train_s = time.monotonic() - t1  # the row's, and the pace's training time
        alone = await collector.report_pace(train_s)
        rewards = [r for g in batch for r in g.rewards]
        row = {
            "step": self.trainer.step,
            "reward": sum(rewards) / len(rewards),
            "trained_on_versions": sorted({g.oldest_version for g in batch}),
            "wait_s": round(t1 - t0, 3),
            "train_s": round(train_s, 3),
            # its estimate of a step alone, as told the coordinator (control/pace.py)
            "step_alone_s": None if alone is None else round(alone, 3),
            "generated": collector.generated,
            "trained": self.buffer.trained,
            "dropped_stale": self.buffer.dropped_stale,
            "buffered": len(self.buffer),
            "failed": collector.failed,
            "cancelled_stale": collector.cancelled_stale,
            "filtered": collector.filtered,
            "resumed": collector.resumed,
            "reprefill_tokens": hooks.router.reprefill_tokens,  # preemption's recompute, so far
            # what this step's version moves to each shard that syncs it (0: not published)
            "sync_bytes": self.sync_bytes,
            **(self.wire_rows.row() if self.wire_rows is not None else {}),
            **self.records.response_stats(batch, collector.env_failed, collector.reward_failed),
            "active_shards": len(hooks.client.active_ranks),
            "time": time.time(),
            **{k: round(v, 5) for k, v in stats.items()},
            **times,
        }
        self.records.record(row)
        self.records.write_samples(batch, version)
        log.info("%s step %d reward %.3f", self.cfg.id, row["step"], row["reward"])

    async def _after_training(
        self,
        hooks: ClusterHooks,
        cache: WeightCache,
        collector: Collector,
        ledger: Ledger,
        version: int,
    ) -> dict[str, float]:
        """Checkpoint, the new weights into the cache, the devices given back and the
        version published; what each took (``time_*_s``, the rest of ``train_s``)."""
        step = self.trainer.step
        times: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            times[f"time_{name}_s"] = round(now - clock, 4)
            clock = now

        if checkpoint_due(step, self.cfg):
            # the buffer as of now, taken on the event loop: the collector keeps adding to
            # it while the checkpoint is written, and the ledger must name what it holds
            buffered = list(self.buffer.groups)
            extra = {"buffer": self.buffer.state_dict(), **collector.state_dict()}
            path = await self._on_trainer_thread(
                self.trainer.save, checkpoint_path(self.out, step), extra
            )
            ledger.checkpoint(step, buffered)  # the step's trajectories are trained for good
            if self.cfg.keep_checkpoints is not None:  # only once the new one is on disk
                prune_checkpoints(path.parent, self.cfg.keep_checkpoints)
        lap("checkpoint")
        self.sync_bytes = 0  # set by _build, if this step's version goes out
        publish = step < self.cfg.steps or eval_due(step, self.cfg.eval_every, self.cfg.steps)
        if publish:
            await self._build(cache)
        lap("cache_build")
        await self._on_trainer_thread(self.trainer.offload)  # never block heartbeats
        # every rank's state is off the devices before they are released
        if self.channel is not None:
            await asyncio.to_thread(self.channel.wait_done, version)
        lap("offload")
        if step < self.cfg.steps:
            await self._publish(hooks, cache)
            collector.set_training(False)
            await collector.report()
        elif eval_due(step, self.cfg.eval_every, self.cfg.steps):
            # the last step's weights go out for their evaluation only: its own progress
            # stream asks for the shards, the rollout's asks for nothing more
            await self._publish(hooks, cache)
            await hooks.client.clear_progress("default")
        else:  # the last step: no rollout will use these weights (the checkpoint has them),
            # and nothing more is collected (shards woken now would sync a cache that
            # is removed as the pipeline exits)
            await hooks.after_training(step, None)
        lap("publish")
        return {**self._train_times, **self.trainer.step_times, **times}

    # --- text recipes: evaluation ---------------------------------------------------------

    def _evaluator(self, hooks: ClusterHooks) -> Evaluator | None:
        if self.recipe is None or not self.cfg.eval_every:
            return None
        prompts = self.recipe.eval_prompts(self.cfg)
        if prompts is None:
            return None
        return Evaluator(
            prompts,
            hooks,
            max_tokens=self.cfg.rollout.max_tokens,
            episodes=self.recipe.eval_episodes,
        )

    def _maybe_eval(self, evaluator: Evaluator | None, version: int) -> None:
        """Evaluate weights ``version`` beside the collector (its row goes to
        metrics.jsonl when done). One runs at a time; one more waits, the newest due:
        an evaluation slower than ``eval_every`` steps skips the versions in between
        (logged) instead of queueing without bound behind the training."""
        if evaluator is None or not eval_due(version, self.cfg.eval_every, self.cfg.steps):
            return
        if self._eval_next is not None:
            log.warning(
                "%s: evaluation of version %d skipped: version %d is due and one is running",
                self.cfg.id,
                self._eval_next,
                version,
            )
        self._eval_next = version
        if self._evals is None or self._evals.done():
            self._evals = asyncio.ensure_future(self._evaluate(evaluator))

    async def _evaluate(self, evaluator: Evaluator) -> None:
        while self._eval_next is not None:
            version, self._eval_next = self._eval_next, None
            try:
                row = await evaluator.run(version)
            except Exception as exc:  # a failed evaluation is reported, not fatal
                log.error("%s: evaluation of version %d failed: %s", self.cfg.id, version, exc)
                row = {"step": version, "eval/error": f"{type(exc).__name__}: {exc}"}
            self.records.record(row)
            log.info("%s eval at version %d: %s", self.cfg.id, version, row.get("eval/reward"))

    def _train(self, batch: list[Group]) -> dict[str, float]:
        """The step on the devices: state back on them, a fresh group, the step, the
        group torn down (what the first two and the last took: ``_train_times``)."""
        t0 = time.perf_counter()
        self.trainer.reload()
        t1 = time.perf_counter()
        self.trainer.init_group(self.store)
        t2 = time.perf_counter()
        try:
            return self.trainer.train_step(batch)
        finally:
            t3 = time.perf_counter()
            self.trainer.destroy_group()
            self._train_times = {
                "time_reload_s": round(t1 - t0, 4),
                "time_group_s": round(t2 - t1 + time.perf_counter() - t3, 4),
            }


def _follower(
    cfg: PipelineConfig, trainer: Trainer, store: dist.Store, channel: BatchChannel
) -> None:
    """Ranks > 0: train on each step's batch when rank 0 posts it."""
    while trainer.step < cfg.steps:
        version = trainer.step
        batch = channel.receive(version)
        trainer.reload()
        trainer.init_group(store)
        try:
            trainer.train_step(batch)
        finally:
            trainer.destroy_group()
        trainer.offload()
        channel.done(version)  # rank 0 releases the devices after every rank's


def _announcing(channel: BatchChannel | None, body: Callable[[], None]) -> None:
    """Run ``body`` and tell the other ranks how it ended (they stop waiting at once)."""
    try:
        body()
    except BaseException as exc:
        if channel is not None:
            channel.announce_exit(f"failed: {type(exc).__name__}: {exc}")
        raise
    if channel is not None:
        channel.announce_exit("finished")


def rank_and_world() -> tuple[int, int]:
    """This process's rank among the trainer's and their number: torchrun's RANK and
    WORLD_SIZE, or for a trainer spanning nodes (a torchrun job per node) the place
    the launcher gave this node's job plus the local rank."""
    if (span := os.environ.get(SPAN_WORLD)) is not None:
        first = int(os.environ[SPAN_FIRST_RANK])
        return first + int(os.environ.get("LOCAL_RANK", "0")), int(span)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def run_pipeline(
    cfg: PipelineConfig, *, resume: bool = False, recipe: Recipe | None = None
) -> None:
    """This rank's part of the pipeline (see :func:`rank_and_world`)."""
    rank, world = rank_and_world()
    store: dist.Store | None = None
    channel: BatchChannel | None = None
    if world > 1 and cfg.trainer_endpoint is not None:  # across nodes: rank 0's store
        assert cfg.keys is not None, "a trainer across nodes has the run's keys (launch --node)"
        pin_links_to(os.environ[SPAN_ADDRESS])
        job = os.environ["RLIX_JOB"]
        secret = trainer_store_secret(cfg.keys, cfg.id, job)
        store = meet_across(cfg.trainer_endpoint, secret, rank, job, STORE_TIMEOUT_S)
    elif world > 1:  # rank 0's loopback store outlives every per-step group
        agent = dist.TCPStore(  # torchrun's: only to find rank 0's (train/rendezvous.py)
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
        )
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        pin_links_to_loopback()
        store = meet(agent, rank, world, local_world, cfg.run_dir, STORE_TIMEOUT_S)
    if store is not None:
        channel = BatchChannel(store, rank, world)
        if rank == 0:  # from now: loading the model and checkpoint may take a while
            channel.start_beat()
    try:
        _announcing(channel, lambda: _run_rank(cfg, rank, world, store, channel, resume, recipe))
    finally:
        if channel is not None:
            channel.stop_beat()
        if store is not None and rank == 0:
            forget(cfg.run_dir)


def _run_rank(
    cfg: PipelineConfig,
    rank: int,
    world: int,
    store: dist.Store | None,
    channel: BatchChannel | None,
    resume: bool,
    recipe: Recipe | None,
) -> None:
    torch.manual_seed(cfg.seed)
    trainer = build_trainer(cfg, rank, world, store)
    ckpt = None
    ckpt_dir = cfg.run_dir / "ckpt"
    if resume and (path := latest_checkpoint(ckpt_dir)) is not None:
        ckpt = trainer.load(path)
        print(f"{cfg.id}: resumed from {path} (step {trainer.step})", flush=True)
    if resume and store is not None:
        same_resume_step(store, rank, trainer.step)

    if rank != 0:
        assert store is not None and channel is not None
        _follower(cfg, trainer, store, channel)
        return

    from rlix_async.aio import run

    cache = WeightCache(cfg.id, bucket_bytes=cfg.weights.bucket_mb << 20)
    try:
        driver = Driver(cfg, trainer, store, ckpt, channel=channel, resumed=resume, recipe=recipe)
        run(driver.run(cache))
    finally:
        cache.close()
        if recipe is not None:
            recipe.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlix_async.pipeline")
    ap.add_argument("--config", required=True, help="pipeline config (YAML or JSON)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. steps=20")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = load_config(args.config, PipelineConfig, args.overrides)
        if not cfg.coordinator:
            raise ConfigError(f"{args.config}: coordinator: required (the coordinator's endpoint)")
        rank, world = rank_and_world()
        if world != cfg.ranks:
            raise ConfigError(
                f"{args.config}: torchrun started {world} ranks but actor_train has "
                f"{cfg.ranks} devices {list(cfg.clusters['actor_train'].devices)}: run "
                f"--nproc-per-node={cfg.ranks} (one rank per device)"
            )
        # rank 0's collector reads the data and calls the reward: checked before any rank
        # loads a model (the launcher checked them too, before starting anything)
        recipe = None
        if cfg.data is not None and rank == 0:
            recipe = load_recipe(cfg)
            recipe.prepare()  # imports that would starve the event loop's heartbeats
    except (ConfigError, RecipeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run_pipeline(cfg, resume=args.resume, recipe=recipe)
    except (RendezvousError, TrainerBackendError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RankGone, EpisodesFailing) as exc:  # torchrun ends the job: the other ranks too
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if recipe is not None and recipe.stuck:
        # a reward call that timed out still runs in a thread, and Python waits for its
        # thread pools at exit: the run is over, so leave without it
        log.warning(
            "%s: %d reward or env call(s) still running; exiting without them", cfg.id, recipe.stuck
        )
        flush_at_exit()  # os._exit skips wandb's atexit hook: its offline run would be empty
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
