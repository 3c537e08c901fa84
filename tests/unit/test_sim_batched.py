"""The batching engine model (sim/engine_time.py, sim/batched.py): its maths alone, the
rule it exists for (a fuller shard: each trajectory later, more tokens a second), and
the fixed model left exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlix_async.cli import main
from rlix_async.config import Scenario, load_config
from rlix_async.config.scenario import EngineCurve
from rlix_async.sim import engine_time as et
from rlix_async.sim.policies import (
    default_engine,
    full_weight,
    make_simulation,
    policies_for,
    simulate,
)

SCENARIOS = Path(__file__).parents[2] / "scenarios"
CURVE = EngineCurve(
    base_s=0.006,
    per_sequence_s=0.0003,
    per_context_token_s=5e-8,
    prefill_per_token_s=4e-5,
    prompt_tokens=512,
)

SHARD = """
cluster: {{nodes: 1, gpus_per_node: 2}}
{engine}
pipelines:
  - id: solo
    steps: 1
    step_target: {n}
    max_trajectory_age_steps: 0
    slots_per_shard: {n}
    rollout: {{dist: fixed, median_s: 10}}
    stages: {{ACTOR_TRAINING: 5}}
    clusters:
      actor_train: {{tp: 1, devices: [1]}}
      actor_infer: {{tp: 1, devices: [0]}}
"""
ENGINE = (
    "engine: {base_s: 0.006, per_sequence_s: 0.0003, per_context_token_s: 5.0e-8, "
    "prefill_per_token_s: 4.0e-5, prompt_tokens: 512}"
)


def _scenario(tmp_path: Path, text: str) -> Scenario:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return load_config(path, Scenario)


# --- the maths, alone ----------------------------------------------------------------------


def test_the_fit_recovers_known_coefficients_from_synthetic_points() -> None:
    points = [
        (b, b * ctx, et.iteration_s(CURVE, b, b * ctx))
        for b in (1, 2, 4, 8, 16)
        for ctx in (100, 2000)
    ]
    a, b, c = et.fit_curve(points)
    assert a == pytest.approx(CURVE.base_s, rel=1e-9)
    assert b == pytest.approx(CURVE.per_sequence_s, rel=1e-9)
    assert c == pytest.approx(CURVE.per_context_token_s, rel=1e-6)
    # with the context term held (points whose context cannot separate it)
    flat = [(b, 0.0, 0.01 + 0.001 * b) for b in (1, 4, 16)]
    assert et.fit_curve(flat, per_context_token_s=0.0) == pytest.approx((0.01, 0.001, 0.0))


def test_the_fit_refuses_points_that_cannot_determine_it() -> None:
    with pytest.raises(ValueError, match="cannot determine"):
        et.fit_curve([(4, 100, 0.01), (4, 100, 0.011)])  # one batch, one context
    with pytest.raises(ValueError, match="triples"):
        et.fit_curve([(1, 0.01)])  # type: ignore[list-item]


def test_decode_time_is_additive_and_its_inverse_exact() -> None:
    batch, ctx = 8, 8 * 600.0
    whole = et.decode_s(CURVE, 300, batch, ctx)
    split = et.decode_s(CURVE, 120, batch, ctx) + et.decode_s(CURVE, 180, batch, ctx + 120 * batch)
    assert split == pytest.approx(whole, rel=1e-12)
    assert et.iterations_in(CURVE, whole, batch, ctx) == pytest.approx(300, rel=1e-12)
    assert et.iterations_in(CURVE, 0.0, batch, ctx) == 0.0


def test_a_trajectorys_time_alone_converts_to_tokens_and_back() -> None:
    for seconds in (0.5, 10.0, 120.0, 3600.0):
        n = et.tokens_alone(CURVE, seconds)
        back = et.prefill_s(CURVE, 512) + et.decode_s(CURVE, n, 1, 512)
        assert back == pytest.approx(seconds, rel=1e-9)
    assert et.tokens_alone(CURVE, 0.001) == 0.0  # shorter than its prefill


def test_batching_trades_latency_for_throughput_on_the_curve() -> None:
    assert et.iteration_s(CURVE, 16, 16 * 1000) > et.iteration_s(CURVE, 1, 1000)
    assert et.tokens_per_s(CURVE, 16, 1000) > 8 * et.tokens_per_s(CURVE, 1, 1000)


def test_the_h100_calibration_is_the_published_points_fitted() -> None:
    h = et.h100_7b()
    for batch, _, seconds in et.H100_POINTS:
        assert et.iteration_s(h, batch, 0) == pytest.approx(seconds, rel=0.12)
    assert 4e-3 < h.base_s < 7e-3 and h.per_context_token_s > 0 and h.prefill_per_token_s > 0


# --- the rule, in the simulator ------------------------------------------------------------


def test_alone_on_an_idle_shard_a_trajectory_takes_its_drawn_time(tmp_path: Path) -> None:
    r = simulate(_scenario(tmp_path, SHARD.format(engine=ENGINE, n=1)), engine="batched")
    assert r["makespan_s"] == pytest.approx(15.0, abs=0.1)  # 10 s rollout + 5 s training


def test_a_fuller_shard_finishes_each_later_but_more_tokens_a_second(tmp_path: Path) -> None:
    alone = simulate(_scenario(tmp_path, SHARD.format(engine=ENGINE, n=1)), engine="batched")
    full = simulate(_scenario(tmp_path, SHARD.format(engine=ENGINE, n=8)), engine="batched")
    rollout_alone = alone["makespan_s"] - 5
    rollout_full = full["makespan_s"] - 5  # all 8 start together and end together
    assert rollout_full > 1.2 * rollout_alone
    assert full["decoded_tokens"] == pytest.approx(8 * alone["decoded_tokens"], rel=1e-3)
    rate_alone = alone["decoded_tokens"] / rollout_alone
    rate_full = full["decoded_tokens"] / rollout_full
    assert rate_full > 4 * rate_alone
    # the fixed model: the same 8 trajectories take 10 s however many share the shard
    fixed = simulate(_scenario(tmp_path, SHARD.format(engine=ENGINE, n=8)), engine="fixed")
    assert fixed["makespan_s"] == 15.0


def test_batched_runs_every_shipped_scenario_to_the_end() -> None:
    for name in ("agentic_longtail", "agentic_lora"):
        sc = load_config(SCENARIOS / f"{name}.yaml", Scenario)
        for pol in policies_for(sc):
            r = simulate(sc, pol, engine="batched")
            assert r["steps"] == sum(p.steps for p in sc.pipelines)
            assert 0 < r["gpu_utilization"] <= 1.0 + 1e-9


# --- the fixed model, exactly as before ----------------------------------------------------

# rlix-async simulate SCENARIO --seed 0 before the batched model existed (commit
# f46e132): (makespan_s, steps/h/GPU, switching GPU-s, preemptions) per policy.
TODAY = {
    "agentic_longtail": {
        "exclusive": (20921.3, 0.21509179639888534, 3584.0, 160),
        "static": (27203.6, 0.6616771309679602, 1120.0, 80),
        "timeshare": (23367.4, 0.7703054947788344, 5604.0, 209),
    },
    "agentic_lora": {
        "exclusive": (4438.6, 1.013833190645699, 7584.0, 160),
        "static": (15476.6, 1.1630461470865694, 3720.0, 80),
        "timeshare": (15549.1, 1.1576208098557275, 1392.0, 28),
        "full_weight": (15826.3, 1.13734662812651, 7612.0, 130),
    },
}


@pytest.mark.parametrize("name", sorted(TODAY))
def test_fixed_reproduces_todays_figures_exactly(name: str, tmp_path: Path) -> None:
    sc = load_config(SCENARIOS / f"{name}.yaml", Scenario)
    assert default_engine(sc) == "fixed"
    for pol, want in TODAY[name].items():
        # time-sharing then divided rollouts by demand (Policy.fairness: demand)
        r = (
            make_simulation(full_weight(sc), fairness="demand").run()
            if pol == "full_weight"
            else simulate(sc, pol, seed=0)
        )
        got = (r["makespan_s"], r["steps_per_hour_per_gpu"], r["wasted_gpu_s"], r["preemptions"])
        assert got == want, pol
    # an engine: section changes nothing under --engine fixed
    text = (SCENARIOS / f"{name}.yaml").read_text() + "\n" + ENGINE + "\n"
    with_curve = _scenario(tmp_path, text)
    assert default_engine(with_curve) == "batched"
    r = simulate(with_curve, "timeshare", seed=0, engine="fixed")
    assert r["makespan_s"] == TODAY[name]["timeshare"][0]


# --- the scenario's engine: section and the command line -----------------------------------


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ("engine: {base_s: 0}", "engine.base_s"),
        ("engine: {base_s: 0.01, per_sequence_s: -1}", "engine.per_sequence_s"),
        ("engine: {base_s: 0.01, prompt_tokens: -5}", "engine.prompt_tokens"),
        ("engine: {base_s: 0.01, per_seq_s: 0.1}", "engine.per_seq_s"),
        ("engine: {per_sequence_s: 0.001}", "engine"),
        ("engine: fast", "engine"),
    ],
)
def test_a_bad_engine_section_is_one_line_and_exit_2(
    engine: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SHARD.format(engine=engine, n=1))
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and field in err


def test_the_cli_picks_the_engine_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    plain = tmp_path / "plain.yaml"
    plain.write_text(SHARD.format(engine="", n=2))
    assert main(["simulate", str(plain), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "fixed"
    assert main(["simulate", str(plain), "--engine", "batched", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "batched" and out["policies"]["timeshare"]["engine"] == "batched"
    curved = tmp_path / "curved.yaml"
    curved.write_text(SHARD.format(engine=ENGINE, n=2))
    assert main(["simulate", str(curved)]) == 0
    assert capsys.readouterr().out.startswith("engine model: batched\n")
    assert main(["simulate", str(curved), "--engine", "fixed", "--seeds", "2"]) == 0
    assert "engine model" not in capsys.readouterr().out


def test_bench_engine_refuses_bad_batches_before_starting_an_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "engine", "--batches", "1,0"]) == 2
    assert "--batches" in capsys.readouterr().err


def test_bench_engine_prints_its_points_and_fit() -> None:
    from rlix_async.bench.engine_curve import format_engine_result

    r = {
        "model": "m",
        "device": "cpu",
        "tokens": 24,
        "points": [
            {"prompt_tokens": 16, "batch": 1, "iteration_ms": 30.0, "tokens_per_s": 33.3},
        ],
        "fit": {
            "base_s": 0.03,
            "per_sequence_s": 0.001,
            "per_context_token_s": 1e-6,
            "prefill_per_token_s": 0.002,
            "worst_relative_error": 0.05,
        },
    }
    r["points"][0]["ttft_ms"] = 54.0
    text = format_engine_result(r)
    assert "30.000 ms + 1.000 ms x batch" in text and "33.3" in text
