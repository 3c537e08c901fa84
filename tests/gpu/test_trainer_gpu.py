"""The torch trainer on a CUDA device (tests/integration/test_trainer.py is the host's share).

A process sees only the devices it is given and each rank takes its own, never one
modulo the count; GRPO steps on the device learn; offload leaves the device empty,
through page-locked host buffers allocated once and reused, and reload restores the
training state bit for bit (a checkpoint taken while offloaded included); NCCL groups
come and go twenty times without growth; a bf16 step agrees with an fp32 one.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.trainer import (
    assert_same_state,
    mass_below_8,
    run_cycles,
    sample_batch,
    state_snapshot,
)

from rlix_async.config import ModelConfig, TorchTrainConfig
from rlix_async.protocols.batch import Group
from rlix_async.train.trainer import TorchTrainer

MiB = 1 << 20
SMALL = ModelConfig(vocab_size=64, layers=1, hidden=64)
# ~107M parameters: float32 weights and Adam state make 1.3 GB, so any part left behind shows
MEDIUM = ModelConfig(vocab_size=32000, layers=4, hidden=1024)
BATCH = [Group([1, 2], [[3, 4, 5], [6, 7, 8]], [[-4.0] * 3] * 2, [[0] * 3] * 2, [1.0, 0.0])] * 2

PROBE = r"""
import json, torch
from rlix_async.config import ModelConfig
from rlix_async.train.trainer import TorchTrainer
t = TorchTrainer(model=ModelConfig(vocab_size=64, layers=1, hidden=64))
print(json.dumps({
    "count": torch.cuda.device_count(),
    "device": str(t.device),
    "params": sorted({str(p.device) for p in t.model.parameters()}),
    "current": torch.cuda.current_device(),
    "uuid": str(torch.cuda.get_device_properties(0).uuid),
}))
"""


def _visible_name(index: int) -> str:
    """This process's device ``index`` as a child's CUDA_VISIBLE_DEVICES names it."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    return mine.split(",")[index].strip() if mine else str(index)


def _probe(visible: str, local_rank: int, local_world: int) -> subprocess.CompletedProcess[str]:
    """Build a trainer in a fresh process started as the launcher starts a rank."""
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": visible,
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
    }
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180
    )


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_used() -> int:
    """Bytes in use on the device, the allocator's and everyone else's (CUDA context, NCCL)."""
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _empty_device() -> tuple[int, int]:
    """Drop what earlier tests left behind; the allocator's bytes allocated and reserved."""
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_a_process_sees_only_the_devices_it_is_given() -> None:
    last = torch.cuda.device_count() - 1
    run = _probe(_visible_name(last), 0, 1)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["count"] == 1
    assert (seen["device"], seen["params"], seen["current"]) == ("cuda:0", ["cuda:0"], 0)
    # its cuda:0 is this process's device `last`: the one the launcher gave it
    assert seen["uuid"] == str(torch.cuda.get_device_properties(last).uuid)


def test_a_rank_without_a_device_of_its_own_fails_in_one_line() -> None:
    """Rank 1 of 2 seeing one device: once NCCL's "Duplicate GPU detected", now our line."""
    name = _visible_name(0)
    run = _probe(name, 1, 2)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert f"local rank 1 of 2 sees 1 CUDA device(s) (CUDA_VISIBLE_DEVICES={name!r})" in last
    assert "the launcher binds one device per rank" in last


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grpo_steps_on_the_device_raise_the_rewarded_tokens_probability(dtype: Any) -> None:
    trainer = TorchTrainer(TorchTrainConfig(lr=1e-2, dtype=dtype), SMALL, seed=0)
    assert trainer.device == torch.device("cuda:0")
    assert {(p.device, p.dtype) for p in trainer.model.parameters()} == {
        (trainer.device, getattr(torch, dtype))
    }
    gen = torch.Generator().manual_seed(0)
    before = mass_below_8(trainer)
    for _ in range(8):
        stats = trainer.train_step(sample_batch(trainer, gen))
        assert stats["is_weight_mean"] == pytest.approx(1.0, abs=0.05)  # on-policy here
    assert mass_below_8(trainer) > 2 * before


def test_twenty_offloads_empty_the_device_and_reloads_restore_it_bit_for_bit(
    tmp_path: Path,
) -> None:
    allocated0, reserved0 = _empty_device()
    used0 = _device_used()
    t = TorchTrainer(TorchTrainConfig(dtype="float32"), MEDIUM, seed=0)
    t.train_step(BATCH)  # the optimizer's state exists from here on
    reloaded = stepped = 0
    first_ptrs: list[int] = []
    first_state: dict[str, torch.Tensor] = {}
    used: list[int] = []
    offload_s, reload_s = [], []
    for i in range(20):
        before = state_snapshot(t) if i in (0, 19) else None
        t0 = time.perf_counter()
        t.offload()
        offload_s.append(time.perf_counter() - t0)
        assert t.offloaded
        # nothing of the trainer stays on the device: the allocator holds nothing more
        # than before it was built, and the driver only what the CUDA libraries keep
        assert torch.cuda.memory_allocated() - allocated0 < MiB
        assert torch.cuda.memory_reserved() - reserved0 <= 2 * MiB
        used.append(_device_used())
        assert used[-1] - used0 < 256 * MiB, (used0, used[-1])
        params = list(t.model.parameters())
        assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
        exp_avg = t.optim.state[params[0]]["exp_avg"]
        assert exp_avg.device.type == "cpu" and exp_avg.is_pinned()
        ptrs = [p.data_ptr() for p in params]
        first_ptrs = first_ptrs or ptrs
        assert ptrs == first_ptrs  # the same page-locked buffers, every cycle
        assert {v.device.type for v in t.weights_for_cache().values()} == {"cpu"}
        if i == 0:
            assert before is not None
            first_state = before
            with pytest.raises(RuntimeError, match=r"reload\(\) first"):
                t.train_step(BATCH)
            t.save(tmp_path / "offloaded.pt", {})
        t0 = time.perf_counter()
        t.reload()
        reload_s.append(time.perf_counter() - t0)
        assert not t.offloaded
        assert {p.device for p in t.model.parameters()} == {t.device}
        if before is not None:
            assert_same_state(state_snapshot(t), before)
        reloaded = reloaded or torch.cuda.memory_allocated()
        assert torch.cuda.memory_allocated() == reloaded
        assert math.isfinite(t.train_step(BATCH)["loss"])
        stepped = stepped or torch.cuda.memory_allocated()
        assert torch.cuda.memory_allocated() == stepped  # no step leaves anything behind
    assert used[-1] - used[1] < 32 * MiB, used

    # a checkpoint written while offloaded loads into a trainer on the device ...
    t.offload()
    fresh = TorchTrainer(TorchTrainConfig(dtype="float32"), MEDIUM, seed=1)
    fresh.load(tmp_path / "offloaded.pt")
    assert_same_state(state_snapshot(fresh), first_state)
    del fresh
    # ... and into an offloaded one, which reload() then brings back whole
    t.load(tmp_path / "offloaded.pt")
    t.reload()
    assert_same_state(state_snapshot(t), first_state)
    assert {v.device for s in t.optim.state.values() for k, v in s.items() if k != "step"} == {
        t.device
    }

    gib = sum(v.nbytes for v in first_state.values()) / (1 << 30)
    print(
        f"offload {gib:.2f} GiB: median {statistics.median(offload_s[1:]):.3f} s, "
        f"reload {statistics.median(reload_s[1:]):.3f} s"
    )


def test_nccl_groups_come_and_go_twenty_times_without_growth(tmp_path: Path) -> None:
    allocated0, _ = _empty_device()
    t = TorchTrainer(TorchTrainConfig(), SMALL, rank=0, world=1)
    store = dist.HashStore()
    used, rss = [], []
    for _ in range(20):
        t.reload()
        t.init_group(store)  # world 1, but a real NCCL communicator (DDP syncs through it)
        assert dist.is_initialized() and dist.get_backend() == "nccl"
        assert math.isfinite(t.train_step(BATCH)["loss"])
        t.destroy_group()
        t.offload()
        assert not dist.is_initialized()
        assert torch.cuda.memory_allocated() - allocated0 < MiB
        used.append(_device_used())
        rss.append(_rss())
    # after warm-up (allocator, lazily loaded kernels) neither the device nor the host grows
    assert used[-1] - used[5] < 64 * MiB, used
    assert rss[-1] - rss[5] < 16 * MiB, rss


@pytest.mark.gpu2
def test_two_torchrun_ranks_cycle_twenty_times_one_device_each(tmp_path: Path) -> None:
    run_cycles(tmp_path, "torch", cuda=True)


def test_a_bf16_step_agrees_with_an_fp32_step() -> None:
    sampler = TorchTrainer(TorchTrainConfig(dtype="float32"), SMALL, seed=0)
    batch = sample_batch(sampler, torch.Generator().manual_seed(0))
    # as if an older policy sampled them: the IS weights vary, so the loss is not ~0
    noise = torch.Generator().manual_seed(1)
    for g in batch:
        g.logprobs[:] = [
            [lp + 0.5 * float(torch.randn((), generator=noise)) for lp in row] for row in g.logprobs
        ]
    steps: dict[str, tuple[dict[str, float], torch.Tensor]] = {}
    for dtype in ("float32", "bfloat16"):
        t = TorchTrainer(TorchTrainConfig(lr=1e-3, minibatches=1, dtype=dtype), SMALL, seed=0)
        start = {n: p.detach().float().clone() for n, p in t.model.named_parameters()}
        stats = t.train_step(batch)
        delta = [(p.detach().float() - start[n]).flatten() for n, p in t.model.named_parameters()]
        steps[dtype] = (stats, torch.cat(delta))
    (fp32, d32), (bf16, d16) = steps["float32"], steps["bfloat16"]
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.1, abs=2e-3)
    assert float(torch.nn.functional.cosine_similarity(d32, d16, dim=0)) > 0.9
    assert float(d16.norm()) == pytest.approx(float(d32.norm()), rel=0.1)


def test_a_pipeline_trainer_touches_its_device_only_from_its_first_reload() -> None:
    """The pipeline builds its trainer before the coordinator grants it anything: the
    state stays in host memory until reload() (called once the stage is granted)."""
    allocated0, _ = _empty_device()
    t = TorchTrainer(TorchTrainConfig(dtype="float32"), MEDIUM, seed=0, start_offloaded=True)
    assert t.offloaded and torch.cuda.memory_allocated() - allocated0 < MiB
    assert {p.device.type for p in t.model.parameters()} == {"cpu"}
    t.reload()
    assert {p.device for p in t.model.parameters()} == {t.device}
    assert math.isfinite(t.train_step(BATCH)["loss"])
    t.offload()
    assert torch.cuda.memory_allocated() - allocated0 < MiB


def test_the_pipelines_build_order_copies_from_the_device_into_the_page_locked_slot() -> None:
    """The pipeline builds the cache while the weights are on the device, then offloads
    (pipeline.py, Driver._build): each tensor goes by DMA into the page-locked slot.
    The other order (offload first, then a host copy into the slot) gives the same
    bytes; both are timed (bench gpu reports them too)."""
    import uuid

    from rlix_async.weights.cache import WeightCache

    t = TorchTrainer(TorchTrainConfig(dtype="bfloat16"), MEDIUM, seed=0)
    t.train_step(BATCH)
    cache = WeightCache("P", f"g{uuid.uuid4().hex[:6]}", bucket_bytes=64 * MiB)
    try:
        cache.build(0, t.weights_for_cache())  # warm: slots created and registered
        assert all(s.pinned for s in cache.slots)
        assert {v.device.type for v in t.weights_for_cache().values()} == {"cuda"}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.build(1, t.weights_for_cache())  # the pipeline's order: from the device
        t1 = time.perf_counter()
        t.offload()
        t2 = time.perf_counter()
        cache.promote(1)  # kept while version 2 goes into the other slot
        t.reload()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        t.offload()  # the other order: offload first, then a host copy
        t4 = time.perf_counter()
        assert {v.device.type for v in t.weights_for_cache().values()} == {"cpu"}
        cache.build(2, t.weights_for_cache())
        t5 = time.perf_counter()
        assert bytes(cache.buffer(1)) == bytes(cache.buffer(2))
    finally:
        cache.close()
    build_dev, build_host = t1 - t0, t5 - t4
    print(
        f"pipeline order: build {build_dev:.4f} s then offload {t2 - t1:.4f} s; "
        f"offload first: offload {t4 - t3:.4f} s then build {build_host:.4f} s"
    )
    assert build_dev <= 1.1 * build_host  # DMA from the device beats a host copy
