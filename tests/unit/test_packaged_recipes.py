"""The packaged recipes: arithmetic's data, its YAML ready to launch, and reward.png with
the eval accuracy beside the batch reward; guess's heavy-tailed games and its LoRA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlix_async.demo import demo_config, plot_rewards
from rlix_async.models.pretrained import MARKER
from rlix_async.recipes import RECIPES, recipe_raw
from rlix_async.recipes.arithmetic import write_data


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_data_is_the_same_every_time_and_eval_is_held_out(tmp_path: Path) -> None:
    train, held_out = write_data(tmp_path / "a")
    again, _ = write_data(tmp_path / "b")
    assert train.read_bytes() == again.read_bytes()
    rows, evals = read(train), read(held_out)
    assert (len(rows), len(evals)) == (3000, 40)
    assert {r["prompt"] for r in rows}.isdisjoint({r["prompt"] for r in evals})
    assert len({r["prompt"] for r in rows}) == 60  # the other 60 one-digit sums
    for r in rows[:20]:
        a, b = (int(x) for x in r["prompt"][len("What is ") :].split("?")[0].split(" + "))
        assert r["answer"] == a + b


def test_too_many_eval_rows_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only 100 distinct sums"):
        write_data(tmp_path, eval_rows=100)


def test_the_demo_recipe_config_points_at_its_data_and_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a converted model is a directory with the marker: stand one in so nothing converts
    cache = tmp_path / "cache"
    model = cache / "models" / RECIPES["arithmetic"][1]
    model.mkdir(parents=True)
    (model / MARKER).write_text("{}")
    monkeypatch.setenv("RLIX_ASYNC_CACHE", str(cache))
    out = tmp_path / "run"
    cfg = demo_config(
        str(out), steps=3, overrides=["pipelines[0].eval_every=1"], recipe="arithmetic"
    )
    (p,) = cfg.pipelines
    assert p.steps == 3 and p.eval_every == 1
    assert p.model.path == str(model)
    assert p.data is not None and Path(p.data.train).parent == out / "data"
    assert Path(p.data.train).is_file() and p.data.eval and Path(p.data.eval).is_file()
    # everything else is the packaged YAML's
    assert (
        p.env.reward == recipe_raw("arithmetic")["pipelines"][0]["env"]["reward"] == "math_answer"
    )


def test_guess_games_are_mostly_small_with_a_few_large_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Game sizes are log-uniform from 1..2 to 1..128: the long tail of episode lengths
    comes from a few large games. The recipe trains a LoRA on the last 4 layers."""
    from rlix_async.recipes import guess

    train, held_out = guess.write_data(tmp_path / "a")
    assert train.read_bytes() == guess.write_data(tmp_path / "b")[0].read_bytes()
    rows = read(train)
    highs = sorted(r["high"] for r in rows)
    assert highs[0] == 2 and highs[-1] == 128 and len(rows) == guess.TRAIN_ROWS
    assert 12 <= highs[len(highs) // 2] <= 20  # median ~ 2^4
    assert 0.12 < sum(h >= 64 for h in highs) / len(highs) < 0.22  # the tail: ~1/6
    assert all(r["low"] == 1 <= r["target"] <= r["high"] for r in rows + read(held_out))
    with pytest.raises(ValueError, match="at least two numbers"):
        guess.write_data(tmp_path / "c", high=1)
    cache = tmp_path / "cache"
    (cache / "models" / RECIPES["guess"][1]).mkdir(parents=True)
    (cache / "models" / RECIPES["guess"][1] / MARKER).write_text("{}")
    monkeypatch.setenv("RLIX_ASYNC_CACHE", str(cache))
    (p,) = demo_config(str(tmp_path / "run"), steps=2, recipe="guess").pipelines
    assert p.lora is not None and p.lora.layers == [26, 27, 28, 29]
    assert p.env.env_class == "rlix_async.recipes.guess:GuessNumber" and p.env.max_turns == 16


def test_reward_png_shows_eval_accuracy_when_a_pipeline_evaluates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.figure

    cfg = demo_config(str(tmp_path), steps=2)
    evaluating = cfg.pipelines[0].id
    for p in cfg.pipelines:
        (tmp_path / p.id).mkdir()
        rows: list[dict[str, Any]] = [{"step": s, "reward": 0.1 * s} for s in (1, 2)]
        if p.id == evaluating:
            rows += [{"step": s, "eval/reward": 0.5 + 0.1 * s} for s in (0, 2)]
        (tmp_path / p.id / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list[Any] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    plot_rewards(cfg, tmp_path / "reward.png")
    (fig,) = drawn
    assert len(fig.axes) == 2
    (line,) = fig.axes[1].get_lines()  # only the pipeline that evaluates
    assert line.get_label() == evaluating
    assert list(line.get_ydata()) == [0.5, 0.7]


def test_the_agent_recipes_data_is_half_one_digit_sums_and_eval_is_held_out(
    tmp_path: Path,
) -> None:
    from rlix_async.recipes.arithmetic_agent import write_data as write_agent_data

    train, held_out = write_agent_data(tmp_path / "a")
    assert train.read_bytes() == write_agent_data(tmp_path / "b")[0].read_bytes()
    rows, evals = read(train), read(held_out)
    assert (len(rows), len(evals)) == (3000, 40)
    assert {r["prompt"] for r in rows}.isdisjoint({r["prompt"] for r in evals})

    def wide(r: dict[str, Any]) -> bool:  # a two-digit first term
        return int(r["prompt"][len("What is ") :].split(" + ")[0]) >= 10

    assert sum(map(wide, evals)) == 20 and sum(map(wide, rows)) == 1500
    for r in rows[:50]:
        a, b = (int(x) for x in r["prompt"][len("What is ") :].split("?")[0].split(" + "))
        assert r["answer"] == a + b and b < 10


def test_the_main_demo_is_the_two_recipes_time_sharing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlix-async demo` runs the arithmetic and agent recipes as two pipelines: each on
    its own recipe's data (in its own directory: both write train.jsonl) and settings,
    so the pair cannot drift from the recipes it shows; only the layout, the steps and
    the micro-batch cap (memory, not maths) are its own. A device is shared and each
    trainer's device is one of its own shards, so training shrinks and expands."""
    from rlix_async.demo import MAIN
    from rlix_async.recipes.arithmetic_agent import write_data as write_agent_data

    cache = tmp_path / "cache"
    (cache / "models" / RECIPES[MAIN][1]).mkdir(parents=True)
    (cache / "models" / RECIPES[MAIN][1] / MARKER).write_text("{}")
    monkeypatch.setenv("RLIX_ASYNC_CACHE", str(cache))
    out = tmp_path / "run"
    cfg = demo_config(str(out), recipe=MAIN)
    arithmetic, agent = cfg.pipelines
    assert (arithmetic.id, agent.id) == ("arithmetic", "arithmetic_agent")
    own = {
        "arithmetic": write_data(tmp_path / "a"),
        "arithmetic_agent": write_agent_data(tmp_path / "b"),
    }
    for p in cfg.pipelines:
        assert p.data is not None and p.data.eval is not None
        assert Path(p.data.train).parent == out / "data" / p.id
        train, held_out = own[p.id]
        assert Path(p.data.train).read_bytes() == train.read_bytes()
        assert Path(p.data.eval).read_bytes() == held_out.read_bytes()
        assert p.steps == recipe_raw(MAIN)["pipelines"][0]["steps"] == 10  # the pair's own
        alone = demo_config(str(tmp_path / p.id), recipe=p.id).pipelines[0]
        assert alone.steps == 15  # a recipe alone: 15 unless told, not its YAML's
        layout = ("clusters", "steps", "checkpoint_every", "data", "train")
        for field in type(p).__struct_fields__:
            if field not in layout:
                assert getattr(p, field) == getattr(alone, field), (p.id, field)
        assert p.train == type(p.train)(
            **{
                **{f: getattr(alone.train, f) for f in type(p.train).__struct_fields__},
                "max_tokens_per_micro_batch": 512,
            }
        ), p.id
    infer = [set(p.clusters["actor_infer"].devices) for p in cfg.pipelines]
    assert infer[0] & infer[1], "no device is shared"
    for p, shards in zip(cfg.pipelines, infer, strict=True):
        assert set(p.clusters["actor_train"].devices) <= shards - (infer[0] & infer[1])


def test_the_tiny_moe_recipe_makes_its_model_once_and_launches_at_expert_parallel_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No download: the recipe makes a random Qwen3-MoE into the model cache the first
    time (whole or not at all) and finds it after; its layout is valid at launch (8
    experts over ep 2, the megatron backend, routes replayed)."""
    from rlix_async.config.training import replays_routes
    from rlix_async.train.megatron_hf import model_shape

    monkeypatch.setenv("RLIX_ASYNC_CACHE", str(tmp_path / "cache"))
    cfg = demo_config(str(tmp_path / "run"), steps=2, recipe="tiny_moe")
    (p,) = cfg.pipelines
    model = tmp_path / "cache" / "models" / "tiny-qwen3-moe"
    assert p.model.path == str(model) and not list(model.parent.glob(".tiny-qwen3-moe*"))
    moe = model_shape(str(model))["moe"]
    assert (moe["experts"], moe["topk"], moe["layers"]) == (8, 2, [1, 1])
    assert p.clusters["actor_train"].ep == 2 and replays_routes(p.train, p.model)
    made = (model / "model.safetensors").stat().st_mtime_ns
    demo_config(str(tmp_path / "again"), steps=2, recipe="tiny_moe")
    assert (model / "model.safetensors").stat().st_mtime_ns == made  # found, not remade
