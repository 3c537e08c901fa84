"""Trainer helpers shared by the torch and Megatron trainer tests: a batch sampled from
the trainer's own model, the probability mass a reward pushes up, a Megatron trainer's
logits, and the torchrun offload-cycle check."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from rlix_async.protocols.batch import Group
from rlix_async.train.trainer import TorchTrainer


def megatron_logits(trainer: Any, ids: torch.Tensor) -> torch.Tensor:
    """A Megatron trainer's logits on ``ids`` (its eval model, no gradient), under a
    private one-rank parallel state made and destroyed around the forward."""
    trainer.parallel_state(None)
    try:
        with torch.no_grad():
            return trainer.parallel.logits(trainer.model.eval(), ids)
    finally:
        trainer.destroy_group()


def sample_batch(trainer: TorchTrainer, gen: torch.Generator) -> list[Group]:
    """Sample from the trainer's own model; reward = share of tokens below 8.

    The model runs on its device; tokens are drawn on the host from float32
    probabilities with the host generator ``gen``, so a seed gives the same draws
    on any device and dtype."""
    groups = []
    model = trainer.model.eval()
    device = next(model.parameters()).device
    for _ in range(4):
        prompt = torch.randint(1, 64, (3,), generator=gen).tolist()
        responses, lps = [], []
        for _ in range(4):
            ids = torch.tensor([prompt], device=device)
            out, logp = [], []
            with torch.no_grad():
                for _ in range(6):
                    logits = model(input_ids=ids).logits[0, -1].float().cpu()
                    probs = torch.softmax(logits, -1)
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                    out.append(tok)
                    logp.append(float(torch.log(probs[tok])))
                    ids = torch.cat([ids, torch.tensor([[tok]], device=device)], 1)
            responses.append(out)
            lps.append(logp)
        rewards = [sum(t < 8 for t in r) / len(r) for r in responses]
        groups.append(Group(prompt, responses, lps, [[0] * 6] * 4, rewards))
    return groups


def mass_below_8(trainer: TorchTrainer) -> float:
    device = next(trainer.model.parameters()).device
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([[5, 9, 13]], device=device)).logits[0, -1]
    return float(torch.softmax(logits.float(), -1)[:8].sum())


def state_snapshot(trainer: TorchTrainer) -> dict[str, object]:
    """Every entry of the training state (model and optimizer), tensors copied to the
    host. Other entries are kept as they are: Megatron's layers put ``_extra_state``
    (None without Transformer Engine) in their state dicts."""

    def host(v: object) -> object:
        return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v

    out = {f"model.{k}": host(v) for k, v in trainer.model.state_dict().items()}
    for i, state in trainer.optim.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": host(v) for k, v in state.items()})
    return out


def assert_same_state(got: dict[str, object], want: dict[str, object]) -> None:
    """Same keys; tensors of the same dtypes and values, bit for bit; other entries equal."""
    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == v.dtype and torch.equal(g, v), k
        else:
            assert g == v, k


CYCLES = r"""
import gc, json, os, sys, torch, torch.distributed as dist
from rlix_async.config import MegatronTrainConfig, ModelConfig, TorchTrainConfig
from rlix_async.protocols.batch import Group
from rlix_async.train.trainer import TorchTrainer
out_dir, backend = sys.argv[1], sys.argv[2]
tp = 2 if backend == "megatron_tp2" else 1  # both ranks one replica
pp = 2 if backend == "megatron_pp2" else 1  # both ranks one replica, one stage each
ep = 2 if backend == "megatron_ep2" else 1  # two replicas, two of the MoE's experts each
kw = {}
if backend.startswith("megatron"):
    from megatron.core import parallel_state
    from rlix_async.train.megatron import MegatronTrainer as Trainer
    TrainConfig = MegatronTrainConfig
else:
    Trainer, TrainConfig = TorchTrainer, TorchTrainConfig
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
if tp * pp * ep > 1:
    kw = {"tp": tp, "pp": pp, "ep": ep, "store": store}
if ep > 1:  # a tiny Qwen3-MoE directory
    model = ModelConfig(path=sys.argv[3])
else:
    model = ModelConfig(vocab_size=63 if tp > 1 else 64, layers=pp, hidden=64 * tp)
t = Trainer(TrainConfig(), model, rank=rank, world=world, **kw)
cuda = t.device.type == "cuda"
g = [Group([1, 2], [[3, 4, 5], [6, 7, 8]], [[-4.0] * 3] * 2, [[0] * 3] * 2, [1.0, 0.0])] * 2
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
samples, losses, device_bytes, device_used = [], [], [], []
for i in range(20):
    t.reload(); t.init_group(store)
    losses.append(t.train_step(g)["loss"])
    t.destroy_group(); t.offload()
    # after the offload, as the pipeline publishes (rank 0 holds the whole model at tp x pp > 1)
    w = t.weights_for_cache() if tp * pp * ep == 1 or rank == 0 else {}
    assert not dist.is_initialized()
    if backend.startswith("megatron"):
        assert not parallel_state.model_parallel_is_initialized()
    gc.collect()
    samples.append(rss())
    if cuda:
        device_bytes.append(torch.cuda.memory_allocated(t.device))
        free, total = torch.cuda.mem_get_info(t.device)
        device_used.append(total - free)  # NCCL's buffers are outside the allocator
with open(f"{out_dir}/rank{rank}.json", "w") as fh:
    json.dump({"rank": rank, "device": str(t.device), "rss": samples, "losses": losses,
               "device_bytes": device_bytes, "device_used": device_used,
               "weights": {k: v.float().sum().item() for k, v in w.items()}}, fh)
"""


def run_cycles(
    tmp_path: Path, backend: str, timeout: float = 280, cuda: bool = False, model: str = ""
) -> list[dict]:
    """20 train/export/offload/destroy cycles on 2 torchrun ranks; asserts nothing leaked.
    ``backend``: torch, megatron (data parallel 2), megatron_tp2 (tensor parallel 2),
    megatron_pp2 (pipeline parallel 2) or megatron_ep2 (expert parallel 2 of the MoE
    directory ``model``).

    ``cuda=False`` hides every CUDA device (gloo on the host, whatever the machine);
    ``cuda=True`` needs two devices, one per rank, and checks device memory too.
    """
    script = tmp_path / "cycles.py"
    script.write_text(CYCLES)
    env = dict(os.environ)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            str(tmp_path),
            backend,
            model,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if backend not in (
        "megatron_tp2",
        "megatron_pp2",
        "megatron_ep2",
    ):  # (else rank 0 alone holds it whole)
        assert rows[0]["weights"] == rows[1]["weights"]  # DDP kept the replicas identical
    assert [r["device"] for r in rows] == (["cuda:0", "cuda:1"] if cuda else ["cpu", "cpu"])
    for r in rows:
        rss = r["rss"]
        # after warm-up (cycles 1-5: allocator, gloo buffers) RSS stays flat
        growth = rss[-1] - rss[5]
        assert growth < 16 << 20, (
            f"rank {r['rank']}: RSS grew {growth >> 20} MiB over 14 cycles: {rss}"
        )
        assert all(math.isfinite(x) for x in r["losses"])
        if cuda:
            # offloaded, the trainer holds no device memory; NCCL's groups leave none behind
            assert max(r["device_bytes"]) < 1 << 20, r["device_bytes"]
            used = r["device_used"]
            assert used[-1] - used[5] < 64 << 20, f"rank {r['rank']}: device use grew: {used}"
    return rows
