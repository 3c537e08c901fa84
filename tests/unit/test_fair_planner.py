"""Finish-time fairness in the planner (Policy.fairness): rollout devices go to the
pipeline slowed most against its pace alone, within priorities; a starving pipeline
gets a bundle back; without paces it plans as ``demand`` does."""

from __future__ import annotations

import random

import msgspec
import pytest

from rlix_async.bench.snapshots import random_snapshot
from rlix_async.control.fair_shares import (
    FAIRNESS_CLIP,
    FAIRNESS_EXPONENT,
    finish_time_factors,
)
from rlix_async.control.plan_checks import check_plan
from rlix_async.control.planner import plan
from rlix_async.protocols.snapshot import PipelineIn, Policy, ProgressIn, RequestIn, Snapshot
from rlix_async.protocols.topology import INFER, ClusterShape, ClusterSpec

FAIR, DEMAND = Policy(fairness="finish_time"), Policy(fairness="demand")


def _snap(
    devices: int,
    pipes: list[tuple[str, float | None, float]],
    policy: Policy = FAIR,
    active: dict[str, list[int]] | None = None,
    held_train: bool = False,
) -> Snapshot:
    """Pipelines (id, slowdown, stalled_s) each wanting 64 trajectories on every
    device; with ``held_train`` the first half is held by a training stage."""
    infer = ClusterSpec(1, tuple(range(devices)))
    train = ClusterSpec(1, tuple(range(devices // 2)))
    out = []
    for i, (pid, slowdown, stalled) in enumerate(pipes):
        held = {"actor_train": "ACTOR_TRAINING"} if held_train and i == 0 else {}
        out.append(
            PipelineIn(
                id=pid,
                clusters={INFER: infer, "actor_train": train},
                held=held,  # type: ignore[arg-type]
                progress=ProgressIn(target=64, completed=0),
                active_ranks={INFER: (active or {}).get(pid, [])} if active else {},
                slowdown=slowdown,
                stalled_s=stalled,
            )
        )
    return Snapshot(
        cluster=ClusterShape(nodes=1, gpus_per_node=devices), pipelines=out, policy=policy
    )


def _shares(snap: Snapshot) -> dict[str, int]:
    result = plan(snap)
    assert check_plan(snap, result) == []
    got = {p.id: len(p.active_ranks.get(INFER, [])) for p in snap.pipelines}
    for ch in result.shrink:
        got[ch.pipeline] -= len(ch.ranks)
    for ch in result.expand:
        got[ch.pipeline] += len(ch.ranks)
    return got


def test_factors_scale_by_slowdown_over_the_mean_clipped() -> None:
    f = finish_time_factors({"a": 2.0, "b": 1.0, "c": None, "d": 3.0})
    assert f["c"] == 1.0  # unknown: as if at the mean
    assert f["a"] == 1.0  # at the mean of the known ones (2.0)
    assert f["d"] == pytest.approx(1.5**FAIRNESS_EXPONENT)
    assert f["b"] == pytest.approx(0.5**FAIRNESS_EXPONENT)
    far = finish_time_factors({**{k: 1.0 for k in "abcd"}, "e": 1000.0})  # mean 200.8
    assert far["e"] == pytest.approx(FAIRNESS_CLIP**FAIRNESS_EXPONENT)  # 4.98 clipped
    assert far["a"] == pytest.approx(FAIRNESS_CLIP**-FAIRNESS_EXPONENT)  # 0.005 clipped
    assert finish_time_factors({"a": None}) == {"a": 1.0}
    # a slowdown of 0 (built in-process, where msgspec's gt=0 is not checked) is no
    # pace: read as unknown, not divided by
    assert finish_time_factors({"a": 0.0, "b": 0.0}) == {"a": 1.0, "b": 1.0}


def test_the_pipeline_slowed_most_gets_more_of_the_rollout_devices() -> None:
    """Equal demand: demand splits 8 devices 4/4; finish-time gives the pipeline at 3x
    its pace alone more than the one at 1.5x (and never less than one to either)."""
    pipes = [("slow", 3.0, 0.0), ("fast", 1.5, 0.0)]
    assert _shares(_snap(8, pipes, DEMAND)) == {"slow": 4, "fast": 4}
    fair = _shares(_snap(8, pipes))
    assert fair["slow"] > 4 and fair["slow"] + fair["fast"] == 8 and fair["fast"] >= 1


def test_without_paces_finish_time_plans_exactly_as_demand() -> None:
    """No pipeline reported a pace (a fresh cluster, or a coordinator that has just
    restarted): every factor is 1 and every pipeline is owed its bundle, so the plan
    is demand's, bit for bit, on random snapshots of every size."""
    rng = random.Random(7)
    for _ in range(60):
        snap = random_snapshot(rng, gpus=rng.choice([8, 16, 64]), pipelines=rng.choice([2, 4, 12]))
        fair = msgspec.structs.replace(snap, policy=FAIR)
        demand = msgspec.structs.replace(snap, policy=DEMAND)
        assert plan(fair) == plan(demand)


def test_random_snapshots_with_paces_give_valid_plans() -> None:
    rng = random.Random(11)
    for _ in range(60):
        snap = random_snapshot(
            rng,
            gpus=rng.choice([8, 16, 64]),
            pipelines=rng.choice([2, 4, 12]),
            fairness="finish_time",
        )
        assert check_plan(snap, plan(snap)) == []


def test_a_pipeline_ahead_waits_and_says_why() -> None:
    """Two free devices, three pipelines: the two slowed most get them; the one
    ahead of its pace waits, and the reason names fairness (demand would give the
    two devices by id and blame stages)."""
    pipes = [("a", 1.0, 0.0), ("b", 3.0, 0.0), ("c", 3.0, 0.0)]
    snap = _snap(2, pipes)
    assert _shares(snap) == {"a": 0, "b": 1, "c": 1}
    [waiting] = plan(snap).waiting
    assert waiting.pipeline == "a" and "finish-time fairness" in waiting.reason
    assert _shares(_snap(2, pipes, DEMAND)) == {"a": 1, "b": 1, "c": 0}


def test_a_starving_pipeline_gets_a_bundle_back_from_the_others() -> None:
    """b and c hold both devices; a is ahead of its pace, so it gets none, until its
    progress has stood still for starvation_s: then it is owed one bundle and c (as
    slowed as b, the later id) is shrunk for it."""
    held = {"b": [0], "c": [1]}
    ahead = [("a", 1.0, 0.0), ("b", 3.0, 0.0), ("c", 3.0, 0.0)]
    assert _shares(_snap(2, ahead, active=held)) == {"a": 0, "b": 1, "c": 1}
    starving = [("a", 1.0, FAIR.starvation_s), ("b", 3.0, 0.0), ("c", 3.0, 0.0)]
    snap = _snap(2, starving, active=held)
    result = plan(snap)
    assert [(c.pipeline, c.ranks) for c in result.shrink] == [("c", [1])]
    assert [(c.pipeline, c.ranks) for c in result.expand] == [("a", [1])]
    # a pipeline that never reported a pace is owed its bundle as under demand
    unknown = [("a", None, 0.0), ("b", 3.0, 0.0), ("c", 3.0, 0.0)]
    assert _shares(_snap(2, unknown, active=held))["a"] == 1


def test_priorities_still_win_over_fairness() -> None:
    """The pipeline least slowed asks to train on devices 0-3, where the pipeline
    slowed most has its rollout shards: training outranks rollouts, so the shards are
    shrunk and the training granted, whatever the slowdowns."""
    pipes = [("trainer", 0.5, 0.0), ("b", 4.0, 0.0)]
    snap = _snap(8, pipes, active={"b": [0, 1, 2, 3]})
    ask = RequestIn(seq=1, cluster="actor_train", priority="ACTOR_TRAINING")
    trainer = msgspec.structs.replace(snap.pipelines[0], requests=[ask])
    snap = msgspec.structs.replace(snap, pipelines=[trainer, snap.pipelines[1]])
    result = plan(snap)
    assert check_plan(snap, result) == []
    assert [(g.pipeline, g.devices) for g in result.grants] == [("trainer", [0, 1, 2, 3])]
    assert [(c.pipeline, c.ranks) for c in result.shrink] == [("b", [0, 1, 2, 3])]
