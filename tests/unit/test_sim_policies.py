"""The simulator's baselines and properties over scenarios nobody tuned it on.

The shipped scenarios' figures are regression numbers in docs/PERF.md, not
assertions here: a single hard-coded gain is a test the scheduler can be tuned to.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlix_async.config import ConfigError, Scenario, ScenarioPipeline
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.sim import generate
from rlix_async.sim.policies import (
    POLICIES,
    SHARING,
    compare,
    sharing_slowdowns,
    simulate,
    static_split,
)


def _pipe(
    pid: str, train: int, infer_tp: int = 1, weight: float = 1.0, n: int = 8, **kw: object
) -> ScenarioPipeline:
    return ScenarioPipeline(
        id=pid,
        clusters={
            "actor_train": ClusterSpec(1, tuple(range(train))),
            "actor_infer": ClusterSpec(infer_tp, tuple(range(n))),
        },
        weight=weight,
        **kw,  # type: ignore[arg-type]
    )


def test_static_split_gives_disjoint_aligned_slices_by_weight() -> None:
    sc = Scenario(
        cluster=ClusterShape(nodes=1, gpus_per_node=8),
        pipelines=[_pipe("a", 4, weight=2.0), _pipe("b", 4, infer_tp=2), _pipe("c", 4)],
    )
    split = {p.id: p for p in static_split(sc)}
    slices = {pid: set(p.clusters["actor_infer"].devices) for pid, p in split.items()}
    assert sum(len(s) for s in slices.values()) == 8
    assert not (slices["a"] & slices["b"] or slices["a"] & slices["c"] or slices["b"] & slices["c"])
    assert len(slices["a"]) == 4 and len(slices["b"]) == 2 and len(slices["c"]) == 2
    for p in split.values():  # training on its own slice, never beyond
        assert set(p.clusters["actor_train"].devices) <= set(p.clusters["actor_infer"].devices)


def test_stages_slow_down_linearly_on_a_smaller_slice_unless_fixed() -> None:
    p = _pipe(
        "a",
        4,
        stages={"ACTOR_TRAINING": 100.0, "OLD_LOG_PROBS": 10.0},
        scaling={"OLD_LOG_PROBS": "fixed"},
    )
    assert p.stages_on(2) == {"ACTOR_TRAINING": 200.0, "OLD_LOG_PROBS": 10.0}
    assert p.stages_on(8) == p.stages  # never faster than on the devices it declares
    sc = Scenario(cluster=ClusterShape(nodes=1, gpus_per_node=8), pipelines=[p, _pipe("b", 4)])
    assert static_split(sc)[0].stages["ACTOR_TRAINING"] == 100.0  # 4 of 8: its declared 4
    sc4 = Scenario(
        cluster=ClusterShape(nodes=1, gpus_per_node=8),
        pipelines=[p, *(_pipe(x, 4) for x in "bcd")],
    )
    assert static_split(sc4)[0].stages == {"ACTOR_TRAINING": 200.0, "OLD_LOG_PROBS": 10.0}


def test_a_split_too_small_for_a_bundle_is_a_config_error_naming_the_pipeline() -> None:
    sc = Scenario(
        cluster=ClusterShape(nodes=1, gpus_per_node=8),
        pipelines=[_pipe(x, 2, infer_tp=4) for x in "abcd"],
    )
    with pytest.raises(ConfigError, match="static split: 4 pipelines on 8 devices leave"):
        static_split(sc)
    three_nodes = Scenario(  # a 4-device bundle after a 6-device one would cross a node
        cluster=ClusterShape(nodes=3, gpus_per_node=6),
        pipelines=[
            _pipe("a", 1, infer_tp=6, n=6),
            _pipe("b", 1, infer_tp=4, n=4),
            _pipe("c", 1, infer_tp=4, n=4),
        ],
    )
    with pytest.raises(ConfigError, match="not aligned to its 4-device bundle on 6-device"):
        static_split(three_nodes)
    with pytest.raises(ValueError, match="scaling: stage CRITIC_TRAINING has no time"):
        _pipe("a", 2, scaling={"CRITIC_TRAINING": "fixed"})


# derandomized: the same draws on every run (a property that failed on a fresh random
# draw in CI would be a flake, not a finding); new draws are explored by changing this
@settings(
    max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.integers(0, 10**6), st.sampled_from([0, 1]))
@example(33723, 1)  # the worst index seen over 100 draws (1.62: docs/PERF.md)
def test_properties_on_generated_agentic_scenarios(seed: int, staleness: int) -> None:
    """On any draw: every plan passes the validator and every pipeline finishes (the
    simulation raises otherwise); time-sharing is never below the static split by more
    than the switching it paid, nor below exclusive per device; nobody is starved (the
    fair-share index stays within 1.75: a pipeline left without shards for long
    goes far beyond; why it is not 1.1 on such mixes is in docs/PERF.md)."""
    sc = generate.agentic(seed, staleness=staleness, steps=4)
    runs = {pol: simulate(sc, pol, seed=seed) for pol in POLICIES}
    static = runs["static"]
    assert all(r["steps"] == 16 for r in runs.values())
    for sharing in SHARING:  # both fairness policies
        ts = runs[sharing]
        switching = ts["wasted_gpu_s"] / (ts["devices"] * ts["makespan_s"])
        assert ts["steps_per_hour_per_gpu"] >= static["steps_per_hour_per_gpu"] * (1 - switching)
        c = compare({"exclusive": runs["exclusive"], sharing: ts})
        assert c["gain_vs_exclusive"] >= 1.0
        assert c["fair_share_index"] <= 1.75, c


@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.integers(0, 10**6), st.sampled_from([0, 1]))
@example(981924, 1)  # the worst of 120 random draws (1.36; demand read 1.69 there)
@example(5, 1)  # the draw where demand stepped one pipeline at 1.8x, another at 7x
def test_finish_time_fairness_bounds_the_sharing_index(seed: int, staleness: int) -> None:
    """While the pipelines share, none is slowed much more than the others: the
    sharing index stays within 1.5 under finish-time fairness on ten-step draws
    (docs/PERF.md, "Fair while sharing": 1.36 at worst over 120 random draws, where
    demand reached 1.96). Shorter runs can exceed it: in a six-step draw (495185, one
    step async) a pipeline of short trajectories trains whenever its batch is ready,
    and training outranks every other pipeline's rollouts."""
    sc = generate.agentic(seed, staleness=staleness)
    runs = {pol: simulate(sc, pol, seed=seed) for pol in ("exclusive", "fair")}
    c = compare(runs)
    assert c["policy"] == "fair"
    assert c["sharing_index"] <= 1.5, c


def test_the_same_seed_gives_the_same_figures() -> None:
    sc = generate.agentic(7, staleness=1, steps=3)
    assert simulate(sc, "timeshare", seed=7) == simulate(sc, "timeshare", seed=7)
    assert generate.agentic(7) == generate.agentic(7) != generate.agentic(8)


def test_the_sharing_index_reads_only_the_steps_taken_while_all_pipelines_ran() -> None:
    """Two pipelines. While both run (100-700 s), a steps every 200 s and b every
    600 s; a ends at 700, b then runs alone. Alone, a's steps take 100 s each and b's
    100 s except its third, 300 s (a long tail): the same steps read 2x for a and
    600 / 300 = 2x for b, though b's mean step alone is 120 s (600 / 120 would read
    5x). Steps ended before the last start or after the first finish are not
    counted."""
    timeline = {
        "a": [100.0, 300.0, 500.0, 700.0],
        "b": [0.0, 90.0, 100.0, 700.0, 800.0, 900.0],  # a step ended at 90 s: before a
    }
    alone = {"a": [100.0, 200.0, 300.0, 400.0], "b": [0.0, 90.0, 100.0, 400.0, 500.0, 600.0]}
    assert sharing_slowdowns(timeline, alone) == {"a": 2.0, "b": 2.0}
    steady = {**alone, "b": [0.0, 90.0, 100.0, 200.0, 300.0, 400.0]}  # b's third: 100 s
    sharing = sharing_slowdowns(timeline, steady)
    assert sharing == {"a": 2.0, "b": 6.0}
    runs = {
        "exclusive": {
            "steps_per_hour_per_gpu": 1.0,
            "mean_step_s": {"a": 100.0, "b": 100.0},
            "timeline_s": steady,
        },
        "timeshare": {
            "steps_per_hour_per_gpu": 1.0,
            "mean_step_s": {"a": 200.0, "b": 180.0},
            "timeline_s": timeline,
            "gpu_utilization": 0.5,
        },
    }
    c = compare(runs)
    assert c["policy"] == "timeshare" and c["duty_cycle"] == 0.5
    assert c["sharing_slowdown"] == sharing and c["worst_sharing_slowdown"] == 6.0
    assert c["sharing_index"] == round(6.0 * (1 / 2 + 1 / 6) / 2, 3)  # 2.0
    assert c["fair_share_index"] == 1.0  # the whole run reads 2.0 x 1.0 / 2
    # a pipeline with fewer than two step ends in the window is left out, and with
    # fewer than two pipelines left there is no sharing index
    assert sharing_slowdowns({**timeline, "a": [100.0, 700.0]}, alone) == {}
