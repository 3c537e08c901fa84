"""`rlix-async bench transparency`'s verdict: each rule fails when a run breaks it; and the
run record is read from the files a pipeline writes (a real ledger, metrics rows as the
pipeline writes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlix_async.bench.transparency import RunRecord, compare, format_transparency, read_run
from rlix_async.protocols.batch import Group
from rlix_async.rollout.ledger import LEDGER, Ledger

STEPS = [0, 2]


def run(mode: str, seed: int, evals: dict[int, float], **kw: object) -> RunRecord:
    base: dict[str, object] = {
        "rows": [5, 3, 9, 1],
        "trained_rows": {1: [3, 5], 2: [1, 9]},
        "batch": {1: 32, 2: 32},
        "lag": {1: 0, 2: 1},
        "eval_n": 40,
        "bound": 1,
    }
    base.update(kw)
    return RunRecord(mode=mode, seed=seed, evals=evals, **base)  # type: ignore[arg-type]


def pairs(shared_evals: list[float], **shared_kw: object) -> list[RunRecord]:
    alone = [0.70, 0.80, 0.60]
    out = []
    for s, (a, b) in enumerate(zip(alone, shared_evals, strict=True)):
        out.append(run("alone", s, {0: 0.7, 2: a}))
        out.append(run("shared", s, {0: 0.7, 2: b}, **shared_kw))
    return out


def test_the_same_recipe_shared_is_transparent() -> None:
    result = compare(pairs([0.725, 0.775, 0.60]), STEPS)
    assert result["transparent"]
    assert all(p["same_data_order"] and p["same_batch_sizes"] for p in result["per_seed"])
    assert all(p["trained_rows_overlap"] == 1.0 for p in result["per_seed"])
    assert "transparent: True" in format_transparency(result)


def test_another_data_order_is_caught() -> None:
    result = compare(pairs([0.70, 0.80, 0.60], rows=[5, 3, 1, 9]), STEPS)
    assert not result["transparent"]
    assert not any(p["same_data_order"] for p in result["per_seed"])


def test_a_shorter_run_compares_the_rows_both_drew() -> None:
    # the shared run drew fewer rows (it was stopped earlier): its prefix still matches
    result = compare(pairs([0.70, 0.80, 0.60], rows=[5, 3]), STEPS)
    assert all(p["same_data_order"] and p["rows_compared"] == 2 for p in result["per_seed"])


def test_other_rows_trained_are_reported_not_judged() -> None:
    # timing decides which drawn group lands in which step, and which goes stale
    result = compare(pairs([0.70, 0.80, 0.60], trained_rows={1: [3, 5], 2: [9, 4]}), STEPS)
    assert all(p["trained_rows_overlap"] == 0.75 for p in result["per_seed"])
    assert result["transparent"]


def test_another_batch_size_is_caught() -> None:
    result = compare(pairs([0.70, 0.80, 0.60], batch={1: 32, 2: 28}), STEPS)
    assert not result["transparent"]


def test_staleness_over_the_bound_is_caught() -> None:
    result = compare(pairs([0.70, 0.80, 0.60], lag={1: 0, 2: 2}), STEPS)
    assert not result["transparent"]
    assert result["per_seed"][0]["max_lag"] == {"alone": 1, "shared": 2}


def test_a_consistent_drop_is_caught_even_when_seeds_spread_widely() -> None:
    # alone spreads 0.60-0.80 over seeds; shared is 0.10 lower on every one of them:
    # unpaired, that hides inside the spread; paired by seed, it does not
    result = compare(pairs([0.60, 0.70, 0.50]), STEPS)
    point = next(p for p in result["eval_curve"] if p["step"] == 2)
    assert abs(point["difference"] + 0.10) < 1e-9
    assert not point["within_noise"] and not result["transparent"]


def test_noise_is_at_least_one_eval_question() -> None:
    # the same difference on every seed: zero spread, yet one question either way is noise
    (point,) = compare(
        [
            run(m, s, {2: 0.7 if m == "alone" else 0.725})
            for s in range(3)
            for m in ("alone", "shared")
        ],
        [2],
    )["eval_curve"]
    assert point["noise"] == 1 / 40 and point["within_noise"]


def test_a_missing_evaluation_fails_the_verdict() -> None:
    runs = pairs([0.70, 0.80, 0.60])
    del runs[1].evals[2]  # seed 0's shared run never evaluated step 2 (failed or skipped)
    result = compare(runs, STEPS)
    assert not result["per_seed"][0]["evals_complete"] and not result["transparent"]
    # and with no evaluation at all there is nothing to call transparent
    bare = [run(m, s, {}) for s in range(3) for m in ("alone", "shared")]
    assert not compare(bare, STEPS)["transparent"]


def test_an_evaluation_on_later_weights_fails_the_verdict() -> None:
    # the pipeline evaluates step 2 on weights of at least version 2: a late one ran on 3
    result = compare(pairs([0.70, 0.80, 0.60], eval_off_step=[[2, 3, 3]]), STEPS)
    assert not any(p["evals_on_their_step"] for p in result["per_seed"])
    assert not result["transparent"]


def test_one_seed_is_not_judged() -> None:
    result = compare(pairs([0.70, 0.80, 0.60])[:2], STEPS)
    assert all(p["within_noise"] is None for p in result["eval_curve"])
    assert not result["transparent"]


def test_a_run_is_read_from_its_ledger_and_metrics(tmp_path: Path) -> None:
    pipe = tmp_path / "arithmetic"
    pipe.mkdir()
    # an earlier, interrupted attempt in the same directory: not counted
    old = Ledger(pipe / LEDGER, fresh=True, from_step=0, buffered=[])
    old.requested(old.new_id(), 4, 0, 99)
    old.close()
    ledger = Ledger(pipe / LEDGER, fresh=True, from_step=0, buffered=[])
    ids = []
    for row in (7, 2, 4):
        ids.append(ledger.new_id())
        ledger.requested(ids[-1], 4, 0, row)
    taken = [Group([1], [[2]], [[0.0]], [[0]], [1.0], id=gid) for gid in (ids[1], ids[0])]
    ledger.taken(taken, 0)
    ledger.close()

    def on(lo: int, hi: int) -> dict[str, int]:
        return {"eval/weight_version_min": lo, "eval/weight_version_max": hi}

    rows = [
        {"step": 0, "eval/reward": 0.5, "eval/n": 40.0, "time": 1.0, **on(0, 0)},
        {"step": 1, "reward": 0.2, "trained": 32, "trained_on_versions": [0], "time": 2.0},
        {"step": 2, "reward": 0.3, "trained": 64, "trained_on_versions": [0, 1], "time": 3.0},
        {"step": 2, "eval/reward": 0.6, "eval/n": 40.0, "time": 4.0, **on(2, 2)},
        {"step": 4, "eval/reward": 0.7, "eval/n": 40.0, "time": 5.0, **on(4, 5)},
    ]
    (pipe / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = read_run(tmp_path, "alone", 3, bound=1, wall_s=12.34)
    assert r.rows == [7, 2, 4]
    assert r.trained_rows == {1: [2, 7]}  # taken at version 0: trained into step 1
    assert r.batch == {1: 32, 2: 32}
    assert r.lag == {1: 0, 2: 1}  # step 2 trains at version 1 on a version-0 trajectory
    assert r.evals == {0: 0.5, 2: 0.6, 4: 0.7} and r.eval_n == 40
    assert r.eval_off_step == [[4, 4, 5]]  # part of step 4's eval ran on version 5
    assert (r.seed, r.wall_s, r.neighbour_steps) == (3, 12.3, 0)


def test_a_pipeline_other_than_the_recipe_is_read_from_its_own_directory(tmp_path: Path) -> None:
    """--pair reads both pipelines of a shared run: each from its own ledger and rows."""
    for pid, reward in (("arithmetic", 0.5), ("arithmetic_agent", 0.25)):
        (tmp_path / pid).mkdir()
        Ledger(tmp_path / pid / LEDGER, fresh=True, from_step=0, buffered=[]).close()
        on = {"eval/weight_version_min": 0, "eval/weight_version_max": 0}
        row = {"step": 0, "eval/reward": reward, "eval/n": 40.0, "time": 1.0, **on}
        (tmp_path / pid / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    r = read_run(tmp_path, "shared", 0, bound=1, wall_s=5.0, pipeline="arithmetic_agent")
    assert (r.pipeline, r.evals) == ("arithmetic_agent", {0: 0.25})


def _wall(mode: str, seed: int, pipeline: str, wall_s: float) -> RunRecord:
    return run(mode, seed, {0: 0.5}, pipeline=pipeline, wall_s=wall_s)


def test_the_gain_is_both_alone_one_after_the_other_over_both_shared() -> None:
    from rlix_async.bench.transparency_pair import format_pair, wall_gain

    runs = []
    for seed, (a, b, sa, sb) in enumerate([(300, 500, 420, 600), (320, 480, 400, 640)]):
        runs += [_wall("alone", seed, "arith", a), _wall("alone", seed, "agent", b)]
        runs += [_wall("shared", seed, "arith", sa), _wall("shared", seed, "agent", sb)]
    runs.append(_wall("alone", 2, "arith", 300))  # a seed cut short: not paired
    w = wall_gain(runs)
    assert [s["seed"] for s in w["per_seed"]] == [0, 1]
    s0 = w["per_seed"][0]
    # both shared end when the later one does: 600 s against 300 + 500 one after the other
    assert (s0["one_after_the_other_s"], s0["shared_both_s"], s0["gain"]) == (800, 600, 1.333)
    assert s0["slowdown"] == {"agent": 1.2, "arith": 1.4}
    assert w["gain_mean"] == round((800 / 600 + 800 / 640) / 2, 3)
    # two seeds: t(1) = 12.706 times the standard error
    gains = [800 / 600, 800 / 640]
    se = abs(gains[0] - gains[1]) / 2
    assert w["gain_interval"] is not None and abs(w["gain_interval"] - 12.706 * se) < 0.01
    verdict = compare([r for r in runs if r.pipeline == "arith"], [0])
    text = format_pair({"pipelines": {"arith": verdict}, "wall": w, "transparent": False})
    assert "gain 1.29x +- " in text and "both in 600 s, gain 1.33x" in text


def test_the_pair_runs_the_main_demos_config_alone_and_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone is the main demo's config with the other pipeline removed: same devices,
    same settings, the seed, steps and eval cadence set on every pipeline."""
    from rlix_async.bench.transparency_pair import SHARED, pair_config
    from rlix_async.models.pretrained import MARKER
    from rlix_async.recipes import RECIPES

    cache = tmp_path / "cache"
    (cache / "models" / RECIPES["time_sharing"][1]).mkdir(parents=True)
    (cache / "models" / RECIPES["time_sharing"][1] / MARKER).write_text("{}")
    monkeypatch.setenv("RLIX_ASYNC_CACHE", str(cache))
    shared = pair_config(str(tmp_path / "s"), SHARED, 7, 4, 2, lambda _: None)
    alone = pair_config(str(tmp_path / "a"), "arithmetic_agent", 7, 4, 2, lambda _: None)
    assert [p.id for p in shared.pipelines] == ["arithmetic", "arithmetic_agent"]
    (only,) = alone.pipelines
    both = shared.pipelines[1]
    assert (
        (only.seed, only.steps, only.eval_every)
        == (7, 4, 2)
        == (both.seed, both.steps, both.eval_every)
    )
    assert only.clusters == both.clusters and only.train == both.train and only.env == both.env
    assert alone.cluster == shared.cluster and alone.engine == shared.engine
