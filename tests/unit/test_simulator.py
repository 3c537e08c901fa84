"""The simulator against hand-computed cases, on the coordinator's own planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlix_async.config import ConfigError, Scenario, load_config
from rlix_async.sim.engine import Simulation
from rlix_async.sim.policies import simulate

SCENARIOS = Path(__file__).parents[2] / "scenarios"

SOLO = """
cluster: {{nodes: 1, gpus_per_node: 2}}
pipelines:
  - id: solo
    steps: 3
    step_target: 4
    max_trajectory_age_steps: {staleness}
    slots_per_shard: 4
    rollout: {{dist: fixed, median_s: 10}}
    stages: {{ACTOR_TRAINING: 5}}
    clusters:
      actor_train: {{tp: 1, devices: [1]}}
      actor_infer: {{tp: 1, devices: [0]}}
"""


def _scenario(tmp_path: Path, text: str) -> Scenario:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return load_config(path, Scenario)


def test_on_policy_step_is_rollout_plus_training(tmp_path: Path) -> None:
    # 4 trajectories of 10 s on 4 slots, then 5 s of training, three times: 45 s.
    r = simulate(_scenario(tmp_path, SOLO.format(staleness=0)))
    assert r["makespan_s"] == 45.0
    assert r["mean_step_s"] == {"solo": 15.0}
    assert r["preemptions"] == 0


def test_one_step_of_staleness_overlaps_rollout_with_training(tmp_path: Path) -> None:
    # batch 1 at 10 s, trained 10-15; batch 2 rolls out 10-20, trained 20-25; ... 35 s.
    r = simulate(_scenario(tmp_path, SOLO.format(staleness=1)))
    assert r["makespan_s"] == 35.0
    assert r["mean_step_s"] == {"solo": pytest.approx(35 / 3, abs=0.1)}


def test_it_drives_the_coordinators_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_async.control import planner

    calls = []
    real = planner.plan

    def spy(snap):  # type: ignore[no-untyped-def]
        calls.append(snap)
        return real(snap)

    monkeypatch.setattr(planner, "plan", spy)
    sim = Simulation(_scenario(tmp_path, SOLO.format(staleness=0)))
    sim.run()
    assert calls and len(calls) == sim.plans
    assert type(sim.registry).__module__ == "rlix_async.control.registry"


def test_unknown_and_invalid_keys_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"s.yaml: swtich: unknown key \(did you mean switch\?\)"):
        _scenario(tmp_path, SOLO.format(staleness=0) + "swtich: {sleep_s: 1}\n")
    with pytest.raises(
        ConfigError, match=r"pipelines\[0\].clusters: cluster actor_train: devices \[9\]"
    ):
        _scenario(tmp_path, SOLO.format(staleness=0).replace("devices: [1]", "devices: [9]"))


def test_shrunk_trajectories_resume_with_reprefill_cost(tmp_path: Path) -> None:
    """Training on the rollout device cuts the in-flight rollout, which continues later."""
    text = SOLO.format(staleness=1).replace("devices: [1]}", "devices: [0]}")
    text = text.replace("gpus_per_node: 2", "gpus_per_node: 1").replace(
        "slots_per_shard: 4", "slots_per_shard: 4\n    reprefill_s: 1"
    )
    r = simulate(_scenario(tmp_path, text))
    assert r["preemptions"] >= 2 and r["steps"] == 3
    assert r["wasted_gpu_s"] > 0


def test_each_policy_counts_the_devices_it_uses() -> None:
    """Exclusive: every pipeline's own declared devices (4 x 8); static and timeshare:
    the cluster. The gains on this scenario are regression figures in docs/PERF.md."""
    sc = load_config(SCENARIOS / "agentic_longtail.yaml", Scenario)
    runs = {pol: simulate(sc, pol, seed=0) for pol in ("exclusive", "static", "timeshare")}
    assert [r["devices"] for r in runs.values()] == [32, 8, 8]
    assert all(r["steps"] == 40 for r in runs.values())


def test_policies_are_compared_on_the_same_trajectories(tmp_path: Path) -> None:
    """Common random numbers: two pipelines on disjoint devices never interact, so each
    must step exactly as it does alone; a policy comparison is not a comparison of luck."""
    solo = SOLO.format(staleness=0).replace(
        "{dist: fixed, median_s: 10}", "{dist: lognormal, median_s: 10, sigma: 1.0}"
    )
    head, pipe = solo.split("pipelines:\n")
    other = pipe.replace("id: solo", "id: other").replace("[1]", "[3]").replace("[0]", "[2]")
    sc = _scenario(
        tmp_path,
        head.replace("gpus_per_node: 2", "gpus_per_node: 4") + ("pipelines:\n" + pipe + other),
    )
    for seed in (0, 1):
        ex, ts = simulate(sc, "exclusive", seed=seed), simulate(sc, "timeshare", seed=seed)
        assert ex["mean_step_s"] == ts["mean_step_s"]
        assert ex["mean_step_s"]["solo"] != ex["mean_step_s"]["other"]
    assert simulate(sc, seed=0)["makespan_s"] != simulate(sc, seed=1)["makespan_s"]
