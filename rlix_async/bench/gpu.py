"""``rlix-async bench gpu``: what the host<->device copies of weights and training state cost.

Measured in one run on a CUDA device (targets in docs/PERF.md, "GPU figures"):

- cache: ``WeightCache.build`` from bf16 device tensors totalling ``--gib``
  against one plain device-to-host copy of the same bytes into pinned memory
  (target: the cache reaches >= 70% of the pinned copy's throughput);
- offload / reload: ``TorchTrainer.offload()`` and ``reload()`` of a Llama of
  about ``--model-mb`` with its AdamW state, against pinned copies of the same
  bytes each way (target: within 2x of the pinned copy's time);
- what the device still holds after ``offload()``: ``torch.cuda.memory_allocated``
  above what was allocated before the trainer existed (target: near zero,
  under 1% of what was offloaded).

Every timing is the best of ``--repeats`` after one untimed warm-up, with the
device synchronized on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

GIB = 1 << 30
MIB = 1 << 20
TENSOR_BYTES = 32 * MIB  # layer-matrix sized pieces of the cache's device tensors
CACHE_TARGET = 0.70  # cache build throughput / pinned D2H throughput, at least
TRAINER_TARGET = 2.0  # offload (reload) time / pinned D2H (H2D) time, at most
LEFT_TARGET = 0.01  # device bytes left after offload / bytes offloaded, below
LLAMA_HIDDEN, LLAMA_VOCAB = 1024, 16384


def cuda_available() -> bool:
    return torch.cuda.is_available()


def best_seconds(copy: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``copy`` with the device idle before and after (one warm-up)."""
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def pinned_copy_seconds(nbytes: int, repeats: int) -> tuple[float, float]:
    """(device->host, host->device) seconds for ``nbytes`` between one device buffer
    and one pinned host buffer: the floor every other figure is compared with."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = best_seconds(lambda: host.copy_(device, non_blocking=True), repeats)
    h2d = best_seconds(lambda: device.copy_(host, non_blocking=True), repeats)
    return d2h, h2d  # the buffers are freed on return (trainer_offload empties the cache)


def device_tensors(nbytes: int) -> dict[str, torch.Tensor]:
    """bf16 device tensors totalling ``nbytes`` (whole elements), random values."""
    out: dict[str, torch.Tensor] = {}
    left, i = nbytes // 2, 0
    while left > 0:
        n = min(TENSOR_BYTES // 2, left)
        out[f"layers.{i}.weight"] = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        left, i = left - n, i + 1
    return out


def cache_vs_pinned(nbytes: int, repeats: int, bucket_bytes: int = 64 * MIB) -> dict[str, Any]:
    """``WeightCache.build`` from device tensors against a pinned D2H copy of the bytes."""
    from rlix_async.weights.cache import WeightCache

    d2h, _ = pinned_copy_seconds(nbytes, repeats)
    tensors = device_tensors(nbytes)
    cache = WeightCache(f"benchgpu{time.monotonic_ns() % 10**6}", "gpu", bucket_bytes=bucket_bytes)
    try:
        t0 = time.perf_counter()
        cache.build(0, tensors)  # creates, reserves and registers the slots
        setup_s = time.perf_counter() - t0
        versions = iter(range(1, repeats + 2))
        build_s = best_seconds(lambda: cache.build(next(versions), tensors), repeats)
        version = max(cache.versions)
        assert cache.layout is not None
        packed = torch.frombuffer(cache.buffer(version), dtype=torch.uint8)
        starts = cache.layout.bucket_offsets
        bytes_ok = all(
            torch.equal(
                packed[starts[e.bucket] + e.offset :][: e.nbytes],
                tensors[e.name].reshape(-1).view(torch.uint8).cpu(),
            )
            for e in cache.layout.entries
        )
        pinned = all(seg.pinned for seg in cache.slots)
        del packed  # a view of the slot: it would keep the slot mapped past close()
    finally:
        cache.close()
    return {
        "cache_bytes": nbytes,
        "pinned_d2h_gibps": nbytes / d2h / GIB,
        "cache_build_gibps": nbytes / build_s / GIB,
        "cache_ratio": d2h / build_s,
        "cache_setup_s": setup_s,
        "cache_slots_pinned": pinned,
        "cache_bytes_ok": bytes_ok,
    }


def _state_bytes(trainer: Any) -> int:
    """Device bytes of the training state: parameters, buffers, gradients, optimizer."""
    tensors: list[torch.Tensor] = [*trainer.model.parameters(), *trainer.model.buffers()]
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    for state in trainer.optim.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t.device.type == "cuda"
    }
    return sum(storages.values())


def llama_layers(model_mb: int) -> int:
    """Decoder layers for about ``model_mb`` MiB of bf16 parameters (at least one)."""
    h = LLAMA_HIDDEN
    per_layer = (4 * h * h + 3 * h * 2 * h) * 2
    embeddings = 2 * LLAMA_VOCAB * h * 2
    return max(1, round((model_mb * MIB - embeddings) / per_layer))


def trainer_offload(model_mb: int, repeats: int) -> dict[str, Any]:
    """Offload and reload of a trainer holding a model and its AdamW state."""
    from rlix_async.config import ModelConfig, TorchTrainConfig
    from rlix_async.train.trainer import TorchTrainer

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = ModelConfig(vocab_size=LLAMA_VOCAB, layers=llama_layers(model_mb), hidden=LLAMA_HIDDEN)
    trainer = TorchTrainer(TorchTrainConfig(), model)
    device = next(trainer.model.parameters()).device
    ids = torch.randint(0, LLAMA_VOCAB, (2, 64), device=device)
    trainer.model(input_ids=ids).logits.float().mean().backward()
    trainer.optim.step()  # AdamW state exists from the first step on
    trainer.optim.zero_grad(set_to_none=True)
    del ids
    state = _state_bytes(trainer)
    offload_s, reload_s, left = float("inf"), float("inf"), 0
    for i in range(repeats + 1):  # the first cycle may allocate host buffers: untimed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.offload()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        left = max(left, torch.cuda.memory_allocated() - before)
        trainer.reload()
        torch.cuda.synchronize()
        if i:
            offload_s = min(offload_s, t1 - t0)
            reload_s = min(reload_s, time.perf_counter() - t1)
    d2h, h2d = pinned_copy_seconds(state, repeats)
    return {
        "trainer_state_bytes": state,
        "trainer_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
        "offload_gibps": state / offload_s / GIB,
        "reload_gibps": state / reload_s / GIB,
        "pinned_state_d2h_gibps": state / d2h / GIB,
        "pinned_state_h2d_gibps": state / h2d / GIB,
        "offload_vs_pinned": offload_s / d2h,
        "reload_vs_pinned": reload_s / h2d,
        "left_after_offload_bytes": left,
        "left_after_offload_share": left / state,
    }


def run_gpu_bench(gib: float = 2.0, model_mb: int = 400, repeats: int = 3) -> dict[str, Any]:
    if not cuda_available():
        raise RuntimeError("bench gpu needs a CUDA device")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "repeats": repeats,
    }
    result.update(cache_vs_pinned(int(gib * GIB) // 2 * 2, repeats))
    result.update(trainer_offload(model_mb, repeats))
    result["targets_met"] = {
        "cache": result["cache_ratio"] >= CACHE_TARGET and result["cache_bytes_ok"],
        "offload": result["offload_vs_pinned"] <= TRAINER_TARGET,
        "reload": result["reload_vs_pinned"] <= TRAINER_TARGET,
        "left_after_offload": result["left_after_offload_share"] < LEFT_TARGET,
    }
    return result


def format_gpu_result(r: dict[str, Any]) -> str:
    met = {k: "met" if v else "NOT MET" for k, v in r["targets_met"].items()}
    cache_gib, state_mib = r["cache_bytes"] / GIB, r["trainer_state_bytes"] / MIB
    rows = [
        ("what", "GiB/s", "pinned GiB/s", "ratio", "target", ""),
        (
            f"cache build, {cache_gib:.2f} GiB bf16",
            f"{r['cache_build_gibps']:.1f}",
            f"{r['pinned_d2h_gibps']:.1f} (D2H)",
            f"{r['cache_ratio']:.2f}x speed",
            f">= {CACHE_TARGET:.2f}x",
            met["cache"] + ("" if r["cache_bytes_ok"] else " (bytes differ!)"),
        ),
        (
            f"trainer offload, {state_mib:.0f} MiB {r['trainer_dtype']}",
            f"{r['offload_gibps']:.1f}",
            f"{r['pinned_state_d2h_gibps']:.1f} (D2H)",
            f"{r['offload_vs_pinned']:.2f}x time",
            f"<= {TRAINER_TARGET:.1f}x",
            met["offload"],
        ),
        (
            "trainer reload",
            f"{r['reload_gibps']:.1f}",
            f"{r['pinned_state_h2d_gibps']:.1f} (H2D)",
            f"{r['reload_vs_pinned']:.2f}x time",
            f"<= {TRAINER_TARGET:.1f}x",
            met["reload"],
        ),
        (
            "device memory after offload",
            f"{r['left_after_offload_bytes'] / MIB:.1f} MiB",
            "",
            f"{100 * r['left_after_offload_share']:.2f}%",
            f"< {100 * LEFT_TARGET:.0f}%",
            met["left_after_offload"],
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"bench gpu on {r['device']} (torch {r['torch']}, CUDA {r['cuda']})"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(
        f"cache: slots pinned {r['cache_slots_pinned']}, first build (slots created and "
        f"registered) {r['cache_setup_s']:.2f} s"
    )
    return "\n".join(line.rstrip() for line in lines)
