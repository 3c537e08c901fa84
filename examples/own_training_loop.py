"""Join a time-shared cluster from your own training loop: the four hooks.

Start a coordinator and shard workers first (or use `rlix-async launch`), then:

    python examples/own_training_loop.py --coordinator ipc:///.../coordinator.sock

Your loop keeps its own model, optimizer and data; rlix_async only decides
when you may train (``before_training``), moves your new weights to the
rollout shards that need them (``after_training``), and sizes your rollout by
what your next batch still needs (``report_progress``).
"""

from __future__ import annotations

import argparse
import asyncio
import random

from rlix_async import (
    ClusterHooks,
    ClusterSpec,
    Group,
    Sampling,
    TorchTrainConfig,
    TorchTrainer,
    Trajectory,
    WeightCache,
    target_tokens,
)

PROMPTS, SAMPLES = 4, 4


def token_versions(traj: Trajectory) -> list[int]:
    """The weight version of every token, as the router returned it: a request cut by a
    shrink and resumed elsewhere may mix versions, and the trainer's importance weights
    need the truth. (With ``min_version`` set, no shard without a version answers.)"""
    if None in traj.versions:
        raise RuntimeError("a shard answered without a weight version")
    return [v for v in traj.versions if v is not None]


async def main(endpoint: str, steps: int) -> None:
    topology = {
        "actor_train": ClusterSpec(tp=1, devices=(0,)),
        "actor_infer": ClusterSpec(tp=1, devices=(0, 1)),
    }
    trainer = TorchTrainer(TorchTrainConfig(lr=1e-2))  # or your own model + optimizer
    hooks = await ClusterHooks.join(endpoint, "my-experiment", topology)
    task = target_tokens()
    cache = WeightCache("my-experiment")
    rng = random.Random(0)
    sampling = Sampling(max_tokens=8)  # temperature 1, top_p 1: the trainer's defaults too
    try:
        # Packing the weights into shared memory copies the whole model: off the event
        # loop (like training), so heartbeats and the router keep running meanwhile.
        await asyncio.to_thread(cache.build, 0, trainer.weights_for_cache())
        await hooks.after_training(0, cache.promote(0))  # shards start from version 0
        for step in range(1, steps + 1):
            groups = []
            await hooks.report_progress(PROMPTS, 0)  # demand: the planner wakes shards
            for i in range(PROMPTS):  # rollout: the router picks an awake shard
                prompt = task.prompt(rng)
                # min_version: only the newest weights (on-policy); a shard still on older
                # ones refuses, and the router waits for one that has synced
                trajs = await asyncio.gather(
                    *(
                        hooks.router.generate(prompt, sampling, min_version=step - 1)
                        for _ in range(SAMPLES)
                    )
                )
                groups.append(
                    Group(
                        prompt,
                        [t.token_ids for t in trajs],
                        [t.logprobs for t in trajs],
                        [token_versions(t) for t in trajs],  # as the shards reported them
                        [task.score(prompt, t.token_ids) for t in trajs],
                    )
                )
                await hooks.report_progress(PROMPTS, i + 1)
            await hooks.before_training(step)  # waits for the training devices
            # off the event loop, so heartbeats and the router keep running
            stats = await asyncio.to_thread(trainer.train_step, groups)
            await asyncio.to_thread(cache.build, step, trainer.weights_for_cache())
            await hooks.after_training(step, cache.promote(step))  # release + publish
            reward = sum(r for g in groups for r in g.rewards) / (PROMPTS * SAMPLES)
            versions = sorted({v for g in groups for vs in g.versions for v in vs})
            print(
                f"step {step}: reward {reward:.3f} loss {stats['loss']:.4f} "
                f"trained on weight versions {versions}"
            )
        await hooks.clear_progress()
    finally:
        await hooks.close()
        cache.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(main(args.coordinator, args.steps))
