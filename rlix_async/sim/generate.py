"""Scenarios nobody tuned the scheduler on: drawn from a seed.

``agentic(seed)`` is the family the shipped ``agentic_longtail.yaml`` belongs
to, with every pipeline different: four pipelines on one 8-device node, each
declaring the whole node for rollout and devices 0-3 for training, lognormal
trajectory times (median 60-240 s, sigma 0.6-1.4), training 200-400 s plus 60 s
of old log-probs, staggered starts; with ``base``, all LoRA pipelines of one base
group. ``rlix-async scenario agentic --seed N`` writes one as YAML; the property
tests draw many.
"""

from __future__ import annotations

import random

from rlix_async.config import RolloutTimes, Scenario, ScenarioPipeline
from rlix_async.config.scenario import SwitchCosts
from rlix_async.protocols.topology import ClusterShape, ClusterSpec

FAMILIES = ("agentic",)


def agentic(
    seed: int,
    *,
    staleness: int = 0,
    pipelines: int = 4,
    steps: int = 10,
    devices: int = 8,
    base: str | None = None,
) -> Scenario:
    """One draw of the agentic family (see the module docstring)."""
    if pipelines < 1 or steps < 1 or devices < 4 or devices % 4:
        raise ValueError("agentic: pipelines, steps >= 1 and devices a multiple of 4")
    rng = random.Random(f"agentic/{seed}")
    train = ClusterSpec(1, tuple(range(devices // 2)))
    infer = ClusterSpec(1, tuple(range(devices)))
    pipes = [
        ScenarioPipeline(
            id=f"agent-{i}",
            start_s=round(60.0 * i + rng.uniform(0, 60), 1),
            steps=steps,
            step_target=64,
            max_trajectory_age_steps=staleness,
            slots_per_shard=8,
            reprefill_s=5.0,
            rollout=RolloutTimes(
                dist="lognormal",
                median_s=round(rng.uniform(60, 240), 1),
                sigma=round(rng.uniform(0.6, 1.4), 2),
                max_s=3600.0,
            ),
            stages={"ACTOR_TRAINING": round(rng.uniform(200, 400), 1), "OLD_LOG_PROBS": 60.0},
            clusters={"actor_train": train, "actor_infer": infer},
            base=base,
        )
        for i in range(pipelines)
    ]
    return Scenario(
        cluster=ClusterShape(nodes=1, gpus_per_node=devices),
        pipelines=pipes,
        switch=SwitchCosts(sleep_s=2.0, wake_s=4.0, sync_gib_per_s=2.0, model_gib=16.0),
    )
