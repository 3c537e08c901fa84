"""The engine seam: an engine from outside the package (examples/engines/hf_engine.py)
plugs in by config alone. It applies every synced version: its greedy output changes
with the versions and equals what the trainer's exported model decodes; and it runs
the quick demo's time-sharing loop (shrinks, expands, syncs, nothing lost) under
`rlix-async demo --quick`. The trainer, weight cache, transports, coordinator, shard workers
and torchrun are the package's own, unchanged."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cluster import ROOT
from helpers.tiny_text import save_tiny_model

from rlix_async.config import ModelConfig, TorchTrainConfig
from rlix_async.protocols.batch import Group
from rlix_async.protocols.generation import Sampling
from rlix_async.train.export import export_checkpoint
from rlix_async.train.trainer import TorchTrainer
from rlix_async.user_code import load_object
from rlix_async.weights.cache import WeightCache

pytest.importorskip("transformers")

ENGINE = ROOT / "examples" / "engines" / "hf_engine.py"
PROMPT = [5, 17, 40, 3, 99, 7]
TOKENS = 12


def _batch(gen: torch.Generator) -> list[Group]:
    """Two responses per prompt, rewarded 1 and 0: an advantage, so weights move."""
    groups = []
    for _ in range(4):
        prompt = torch.randint(4, 250, (6,), generator=gen).tolist()
        good, bad = (torch.randint(4, 250, (8,), generator=gen).tolist() for _ in range(2))
        lps = [[-5.0] * 8] * 2
        groups.append(Group(prompt, [good, bad], lps, [[0] * 8] * 2, [1.0, 0.0]))
    return groups


def _reference_greedy(hf_dir: Path) -> list[int]:
    """What the exported model decodes greedily: transformers' own generate."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=TOKENS, eos_token_id=None)
    out = model.generate(torch.tensor([PROMPT]), generation_config=config)
    return [int(t) for t in out[0, len(PROMPT) :]]


async def _engine_greedy(engine: object) -> list[int]:
    chunks = [
        c async for c in engine.generate(PROMPT, Sampling(max_tokens=TOKENS, temperature=0.0))
    ]  # type: ignore[attr-defined]
    assert chunks and chunks[-1].finished
    return list(chunks[-1].token_ids)


@pytest.mark.timeout(300)
def test_the_example_engine_serves_each_version_as_the_exported_model_decodes(
    tmp_path: Path,
) -> None:
    base = save_tiny_model(tmp_path / "base", "llama", seed=3)
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    config = tmp_path / "run" / "pipeline.yaml"  # what export reads the base from
    config.write_text(
        f"id: p\nmodel: {{path: {base}}}\n"
        "clusters: {actor_train: {devices: [0]}, actor_infer: {devices: [0]}}\n"
    )
    trainer = TorchTrainer(
        TorchTrainConfig(dtype="float32", lr=3e-2, minibatches=1), ModelConfig(path=str(base))
    )
    engine = load_object(f"{ENGINE}:HfEngine")(str(base))
    cache = WeightCache("hfeng")
    gen = torch.Generator().manual_seed(0)
    served: list[list[int]] = []
    try:
        for version in range(4):
            if version:
                trainer.train_step(_batch(gen))
            cache.build(version, trainer.weights_for_cache())
            asyncio.run(engine.load_version(cache.promote(version)))
            assert engine.weight_version == version
            served.append(asyncio.run(_engine_greedy(engine)))
            ckpt = trainer.save(tmp_path / "run" / "ckpt" / f"step_{version}.pt", {})
            hf = export_checkpoint(ckpt, tmp_path / f"hf{version}", config=config)
            assert served[-1] == _reference_greedy(hf), version
    finally:
        cache.close()
    assert len({tuple(s) for s in served}) > 1, served  # the versions decode differently


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_engine_runs_the_demos_time_sharing_loop(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    engine = f"engine={{kind: custom, custom: '{ENGINE}:BACKEND', max_model_len: 128}}"
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "demo", "--quick", "--out", str(out), "--steps", "4", engine],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_trajectories"] == 0
    for p in summary["pipelines"].values():
        assert p["shrinks"] > 0 and p["expands"] > 0 and p["weight_syncs"] > 0, p
    for log in (out / "logs").glob("shard-*.log"):  # every shard ran the example engine
        assert "Traceback" not in log.read_text(), log
    shard_cfg = next((out / "band-low").glob("shard-*.yaml")).read_text()
    assert "hf_engine.py:BACKEND" in shard_cfg and "kind: custom" in shard_cfg
