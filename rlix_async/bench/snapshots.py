"""Random but realistic cluster snapshots, for the planner benchmark and property tests.

Pipelines sit on node-aligned device ranges (as a cluster operator would place
them), several pipelines share each range, training devices are a prefix of the
inference devices (partial overlap), and the current state (stages held,
generation ranks awake, progress, queued requests) is consistent.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec

from rlix_async.protocols.snapshot import (
    Fairness,
    PipelineIn,
    Policy,
    ProgressIn,
    RequestIn,
    Snapshot,
)
from rlix_async.protocols.topology import INFER, ClusterShape, ClusterSpec, Priority, priority_name

GANG_PRIORITIES = [priority_name(p) for p in Priority if p is not Priority.GENERATION]


def random_snapshot(
    rng: random.Random,
    gpus: int = 16,
    pipelines: int = 4,
    gpus_per_node: int = 8,
    overlap: bool = True,
    fairness: Fairness | None = None,
) -> Snapshot:
    """A snapshot; with ``fairness``, under that policy, and with finish_time each
    pipeline's pace as the coordinator reports it (a slowdown for most, a few never
    measured, one in ten starving)."""
    gpn = min(gpus_per_node, gpus)
    nodes = max(1, gpus // gpn)
    shape = ClusterShape(nodes=nodes, gpus_per_node=gpn)
    owner: set[int] = set()
    seq = iter(range(10**9))
    out: list[PipelineIn] = []
    for i in range(pipelines):
        span_nodes = rng.choice([n for n in (1, 2, 4, 8) if n <= nodes] or [1])
        start_node = rng.randrange(0, nodes - span_nodes + 1)
        infer_devs = list(range(start_node * gpn, (start_node + span_nodes) * gpn))
        if not overlap:
            infer_devs = list(range(gpn * nodes))
        tp = rng.choice([t for t in (1, 2, 4, 8) if t <= gpn and len(infer_devs) % t == 0])
        train_len = max(gpn // 2, 1) if rng.random() < 0.7 else len(infer_devs)
        clusters = {
            "actor_train": ClusterSpec(tp=1, devices=tuple(infer_devs[:train_len])),
            INFER: ClusterSpec(tp=tp, devices=tuple(infer_devs)),
        }
        held: dict[str, str] = {}
        if rng.random() < 0.25 and not owner & set(clusters["actor_train"].devices):
            held["actor_train"] = rng.choice(GANG_PRIORITIES[1:])
            owner.update(clusters["actor_train"].devices)
        active: list[int] = []
        for r, bundle in enumerate(clusters[INFER].bundles()):
            if rng.random() < 0.5 and not owner & set(bundle):
                active.append(r)
                owner.update(bundle)
        target = rng.choice([0, 64, 256, 512])
        progress = (
            ProgressIn(target=target, completed=rng.randrange(0, target + 1) if target else 0)
            if rng.random() < 0.8
            else None
        )
        requests = _random_requests(rng, seq, training_held="actor_train" in held)
        pace: dict[str, float | None] = {}
        if fairness == "finish_time":
            known = rng.random() < 0.9
            pace["slowdown"] = round(rng.lognormvariate(0.4, 0.5), 3) if known else None
            pace["stalled_s"] = rng.choice([0.0] * 9 + [900.0])
        out.append(
            PipelineIn(
                id=f"p{i}",
                clusters=clusters,  # type: ignore[arg-type]
                held=held,  # type: ignore[arg-type]
                active_ranks={INFER: active} if active else {},
                progress=progress,
                requests=requests,
                **pace,  # type: ignore[arg-type]
            )
        )
    policy = Policy() if fairness is None else Policy(fairness=fairness)
    return Snapshot(cluster=shape, pipelines=_arriving_shuffled(rng, out), policy=policy)


def _random_requests(
    rng: random.Random, seq: Iterator[int], training_held: bool
) -> list[RequestIn]:
    """None, a gang request for training (unless it is held), or a generation request."""
    roll = rng.random()
    if not training_held and roll < 0.4:
        return [
            RequestIn(
                seq=next(seq),
                cluster="actor_train",
                priority=rng.choice(GANG_PRIORITIES),
                age_s=rng.choice([0.0, 0.0, 5.0, 500.0]),
            )
        ]
    if roll < 0.7:
        return [
            RequestIn(
                seq=next(seq),
                cluster=INFER,
                priority="GENERATION",
                step_target_estimate=rng.choice([None, 64, 256]),
            )
        ]
    return []


def _arriving_shuffled(rng: random.Random, pipes: list[PipelineIn]) -> list[PipelineIn]:
    """The same pipelines, their requests numbered in a random order of arrival."""
    order = list(range(sum(len(p.requests) for p in pipes)))
    rng.shuffle(order)
    it = iter(order)
    return [
        msgspec.structs.replace(
            p, requests=[msgspec.structs.replace(r, seq=next(it)) for r in p.requests]
        )
        for p in pipes
    ]
