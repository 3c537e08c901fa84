"""The Megatron-core backend on CPU (megatron-core 0.16.1 + the CPU-compat patches).

Slow tier: exact Megatron -> HF conversion (same logits), GRPO steps that
learn, and the time-sharing cycle under torchrun with 2 ranks (20 cycles: no
process group or Megatron parallel state left behind, RSS flat).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

SMALL = {"vocab_size": 64, "layers": 1, "hidden": 64}


def test_megatron_weights_load_into_hf_llama_with_identical_logits() -> None:
    from rlix_async.grpo.megatron_trainer import MegatronTrainer
    from rlix_async.grpo.trainer import TrainerConfig
    from rlix_async.models.tiny import tiny_llama

    t = MegatronTrainer(
        TrainerConfig(seed=3, model={"vocab_size": 512, "layers": 2, "hidden": 128})
    )
    hf = tiny_llama(0).eval()
    hf.load_state_dict(t.weights_for_cache(), strict=True)
    ids = torch.tensor([[5, 17, 300, 2, 9]])
    t._parallel_state(None)
    try:
        with torch.no_grad():
            mg = t.forward_logits(t.model.eval(), ids)
    finally:
        t.destroy_group()
    assert torch.allclose(mg, hf(input_ids=ids).logits, atol=1e-5)


def test_megatron_grpo_steps_learn() -> None:
    from test_grpo_trainer import _batch, _mass_below_8

    from rlix_async.grpo.megatron_trainer import MegatronTrainer
    from rlix_async.grpo.trainer import TrainerConfig
    from rlix_async.models.tiny import tiny_llama

    t = MegatronTrainer(TrainerConfig(lr=1e-2, seed=0, model=SMALL))
    hf = tiny_llama(0, **SMALL).eval()  # samples and measures with the exported weights
    gen = torch.Generator().manual_seed(0)

    class View:  # _batch/_mass_below_8 read `.model` as an HF model
        model = hf

    hf.load_state_dict(t.weights_for_cache())
    before = _mass_below_8(View)  # type: ignore[arg-type]
    for _ in range(8):
        t.train_step(_batch(View, gen))  # type: ignore[arg-type]
        hf.load_state_dict(t.weights_for_cache())
    assert _mass_below_8(View) > 2 * before  # type: ignore[arg-type]


CYCLES = r"""
import gc, json, os, sys, torch, torch.distributed as dist
from megatron.core import parallel_state
from rlix_async.grpo.megatron_trainer import MegatronTrainer
from rlix_async.grpo.trainer import TrainerConfig
from rlix_async.grpo.buffer import Group
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
t = MegatronTrainer(TrainerConfig(model={"vocab_size": 64, "layers": 1, "hidden": 64}), rank, world)
g = [Group([1, 2], [[3, 4, 5], [6, 7, 8]], [[-4.0] * 3] * 2, [[0] * 3] * 2, [1.0, 0.0])] * 2
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
samples, losses = [], []
for i in range(20):
    t.reload(); t.init_group(store)
    losses.append(t.train_step(g)["loss"])
    w = t.weights_for_cache()
    t.destroy_group(); t.offload()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    gc.collect()
    samples.append(rss())
first = {k: v.sum().item() for k, v in w.items()}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as fh:
    json.dump({"rank": rank, "rss": samples, "losses": losses, "weights": first}, fh)
"""


@pytest.mark.timeout(400)
def test_twenty_megatron_cycles_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "cycles.py"
    script.write_text(CYCLES)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert rows[0]["weights"] == rows[1]["weights"]  # DDP kept the replicas identical
    for r in rows:
        growth = r["rss"][-1] - r["rss"][5]
        assert growth < 16 << 20, f"rank {r['rank']}: RSS grew {growth >> 20} MiB: {r['rss']}"
        assert all(x == x for x in r["losses"])  # finite


@pytest.mark.timeout(300)
def test_a_pipeline_trains_with_the_megatron_backend_under_launch(tmp_path: Path) -> None:
    """Scripted shards (a test double; vLLM runs in tests/test_demo.py), real everything else."""
    out = tmp_path / "out"
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"""
out: {out}
cluster: {{nodes: 1, gpus_per_node: 2}}
shard: {{engine: scripted}}
pipelines:
  - id: mg{abs(hash(str(tmp_path))) % 10000}
    backend: megatron
    nproc: 2
    steps: 2
    groups_per_step: 2
    group_size: 2
    max_tokens: 4
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""
    )
    run = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = out.glob("mg*/metrics.jsonl")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
