"""Runs of the Megatron trainer at a tensor (and pipeline) parallel size, under
torchrun (every rank runs this): ``python -m torch.distributed.run --standalone
--nproc-per-node=W megatron_tp.py OUT MODEL TP[xPP[xEP]] STEPS [CKPT]`` for one, or
``... megatron_tp.py --jobs JOBS.json`` for several in turn in one process group (a
list of objects with those fields and ``distributed_optimizer``/``top_p``: each run
costs its steps rather than a torchrun start and Megatron's import). Rank 0 writes
OUT/run.pt: the weight cache before and after the steps, each step's figures and
times, and a checkpoint after the first step (OUT/ckpt_1.pt; under model parallel the
sharded directory OUT/ckpt_1 every rank writes its part of); the last stage's first
rank writes the logits of a fixed input at the start (OUT/logits.pt). With CKPT it resumes
from there first. Every rank writes OUT/rss-RANK.json: its
peak RSS after building the trainer and after the steps, and how many elements its
optimizer state holds. RLIX_DISTRIBUTED_OPTIMIZER=1 shards that state over the
replicas; the sampling temperature is 0.7 and RLIX_TOP_P the nucleus (1: none). Used by
tests/integration/test_megatron_tp.py and for docs/PERF.md's figures."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent.parent))

from helpers.megatron_batches import BATCHES, ODD_BATCHES, with_routes
from rlix_async.config import MegatronTrainConfig, ModelConfig
from rlix_async.train.megatron import MegatronTrainer
from rlix_async.train.packing import Piece

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def stale_groups(trainer: MegatronTrainer) -> int:
    """Process groups rank 0's model holds that are not this step's (Megatron's modules
    keep the groups they were built with; the trainer must point them at each step's)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    current = {id(g) for g in vars(ProcessGroupCollection.use_mpu_process_groups()).values()}
    held = []
    for m in trainer.model.modules():
        for v in vars(m).values():
            if isinstance(v, dist.ProcessGroup):
                held.append(v)
            elif isinstance(v, ProcessGroupCollection):
                held += [g for g in vars(v).values() if isinstance(g, dist.ProcessGroup)]
    return sum(id(g) not in current for g in held)


def run(
    out: Path,
    model_dir: str,
    tp: int,
    pp: int,
    steps: int,
    ckpt: Path | None,
    distributed_optimizer: bool,
    top_p: float,
    ep: int = 1,
    micro_batch_size: int = 2,
    batches: str = "even",
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(out / f"store-{tp}x{pp}x{ep}-{world}-{ckpt is not None}"), world)
    steps_batches = BATCHES if batches != "odd" else ODD_BATCHES
    if batches == "routes":  # a tiny Qwen3-MoE's: 2 MoE layers, top 2 of 4 experts
        steps_batches = with_routes(BATCHES, 2, 2, 4)
    torch.manual_seed(0)
    trainer = MegatronTrainer(
        MegatronTrainConfig(  # two micro-batches per minibatch at one replica: interleaved
            dtype="float32",
            lr=1e-3,
            minibatches=2,
            micro_batch_size=micro_batch_size,
            distributed_optimizer=distributed_optimizer,
        ),
        ModelConfig(path=model_dir),
        seed=0,
        temperature=0.7,
        top_p=top_p,
        rank=rank,
        world=world,
        tp=tp,
        pp=pp,
        ep=ep,
        store=store,
        checkpoint_to=lambda step: out / "ckpt_1.pt" if step == 1 else None,
    )
    peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # bytes (KiB)
    if ckpt is not None:
        trainer.load(ckpt)
    # copies: at tp=1 the cache's tensors are views of the parameters the steps change
    start = {k: v.clone() for k, v in trainer.weights_for_cache().items()} if rank == 0 else None
    record: dict[str, object] = {"cache_start": start}
    ids = torch.tensor([[5, 9, 13, 2, 7, 30]])
    trainer.init_group(store)
    logits: list[torch.Tensor] = []  # on the last stage: every position's

    def keep(x: torch.Tensor) -> torch.Tensor:
        if trainer.parallel.vocab_parallel:  # each rank's vocabulary slice: the whole
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            x = gather_from_tensor_model_parallel_region(x)[..., : trainer._shape["vocab_size"]]
        logits.append(x.detach().clone())
        return x.new_zeros(())

    with torch.no_grad():
        trainer.model.eval()
        trainer.parallel.forward(trainer.model, [Piece(ids, ids.shape[1] - 1, keep)])
        trainer.model.train()
    lay = trainer.layout
    if logits and lay.tp_rank == 0 and lay.dp_rank == 0:
        torch.save(logits[0], out / "logits.pt")
    stale: list[int] = [stale_groups(trainer)]  # the first step's groups, then each later's
    figures: list[dict[str, float]] = []
    times: list[dict[str, float]] = []  # where each step's time went (step_times)
    for s in range(steps):
        if s:
            trainer.init_group(store)
            stale.append(stale_groups(trainer))
        figures.append(trainer.train_step(steps_batches[trainer.step % len(steps_batches)]))
        times.append(dict(trainer.step_times))
        trainer.destroy_group()
        if rank == 0 and trainer.step == 1 and ckpt is None:
            t0 = time.perf_counter()
            trainer.save(out / "ckpt_1.pt", {})
            record["save_s"] = time.perf_counter() - t0
    record["figures"], record["times"], record["stale_groups"] = figures, times, stale
    peak_steps = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    state = trainer.optim.state.values()
    optim_elems = sum(v.numel() for st in state for v in st.values() if v.dim())
    (out / f"rss-{rank}.json").write_text(
        json.dumps({"load": peak_load, "steps": peak_steps, "optim_elems": optim_elems})
    )
    if rank == 0:
        record["cache_end"] = trainer.weights_for_cache()
        torch.save(record, out / "run.pt")


def jobs_from_argv(argv: list[str]) -> list[dict[str, Any]]:
    if argv[1] == "--jobs":
        jobs: list[dict[str, Any]] = json.loads(Path(argv[2]).read_text())
        return jobs
    tp_text, pp_text, ep_text = [*argv[3].split("x"), "1", "1"][:3]
    return [{
        "out": argv[1], "model": argv[2], "tp": int(tp_text), "pp": int(pp_text),
        "ep": int(ep_text),
        "steps": int(argv[4]), "ckpt": argv[5] if len(argv) > 5 else None,
        "distributed_optimizer": os.environ.get("RLIX_DISTRIBUTED_OPTIMIZER") == "1",
        "top_p": float(os.environ.get("RLIX_TOP_P", "1")),
    }]  # fmt: skip


for job in jobs_from_argv(sys.argv):
    run(
        Path(job["out"]), job["model"], job["tp"], job.get("pp", 1), job["steps"],
        Path(job["ckpt"]) if job.get("ckpt") else None,
        job.get("distributed_optimizer", False), job.get("top_p", 1.0),
        job.get("ep", 1), job.get("micro_batch_size", 2), job.get("batches", "even"),
    )  # fmt: skip
