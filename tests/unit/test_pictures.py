"""Every picture of a run gives a pipeline the same colour (the demo's reward.png and
timeline.png once gave band-low orange in one and blue in the other)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlix_async.demo import demo_config, plot_rewards
from rlix_async.observe.timeline import pipeline_colours


def test_a_pipeline_keeps_its_colour_whatever_the_order() -> None:
    assert pipeline_colours(["band-low", "band-high"]) == pipeline_colours(
        ["band-high", "band-low"]
    )
    colours = pipeline_colours(["a", "b", "c"])
    assert len(set(colours.values())) == 3


def test_the_reward_plot_uses_the_timelines_colours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.figure

    cfg = demo_config(str(tmp_path), steps=2)
    ids = [p.id for p in cfg.pipelines]
    assert ids != sorted(ids)  # the config lists them in another order than the timeline
    for pid in ids:
        (tmp_path / pid).mkdir()
        rows = [{"step": s, "reward": 0.1 * s} for s in (1, 2)]
        (tmp_path / pid / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list[Any] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    plot_rewards(cfg, tmp_path / "reward.png")
    (fig,) = drawn
    lines = {line.get_label(): tuple(line.get_color()) for line in fig.axes[0].get_lines()}
    assert lines == pipeline_colours(ids)
