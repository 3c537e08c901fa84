"""A LoRA adapter trained on CUDA with the torch backend (tests/integration/test_lora_trainer.py
is the host's share): a step moves only the adapter, on the device; bf16 keeps the
base in bf16 and the adapter in float32; offload empties the device of base, adapter
and optimizer state, and reload brings them back bit for bit. Needs peft (on the GPU
machine with transformers)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from helpers.tiny_text import save_tiny_model

from rlix_async.config import ModelConfig, TorchTrainConfig
from rlix_async.config.lora import LoraConfig
from rlix_async.protocols.batch import Group
from rlix_async.train.trainer import TorchTrainer

LORA = LoraConfig(rank=2, alpha=8.0)
MiB = 1 << 20
BATCH = [
    Group([1, 2], [[3, 4, 5, 6], [9]], [[-3.0] * 4, [-3.0]], [[0] * 4, [0]], [1.0, 0.0]),
    Group(
        [5, 6], [[10, 11], [12, 13, 14]], [[-3.0] * 2, [-3.0] * 3], [[0] * 2, [0] * 3], [0.0, 1.0]
    ),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lora") / "base", "llama", seed=0)


def _trainer(base: Path, dtype: str = "float32") -> TorchTrainer:
    cfg = TorchTrainConfig(dtype=dtype, lr=1e-2, minibatches=1)  # type: ignore[arg-type]
    return TorchTrainer(cfg, ModelConfig(path=str(base)), seed=0, lora=LORA)


def _split(t: TorchTrainer) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    named = dict(t.model.named_parameters())
    adapter = {n: p for n, p in named.items() if "lora_" in n}
    return adapter, {n: p for n, p in named.items() if n not in adapter}


def test_a_lora_step_on_the_device_moves_only_the_adapter(base: Path) -> None:
    t = _trainer(base)
    adapter, frozen = _split(t)
    assert {p.device.type for p in t.model.parameters()} == {"cuda"}
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    for _ in range(2):  # the first moves only B (A's gradient is B's, zero at the start)
        stats = t.train_step(BATCH)
        assert stats["grad_norm"] > 0
    assert all(torch.equal(p, before[n]) for n, p in frozen.items())
    assert all(not torch.equal(p, before[n]) for n, p in adapter.items())


def test_bf16_keeps_the_base_in_bf16_and_trains_the_adapter_in_float32(base: Path) -> None:
    t = _trainer(base, "bfloat16")
    adapter, frozen = _split(t)
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    assert {p.dtype for p in adapter.values()} == {torch.float32}
    t.train_step(BATCH)
    assert {v.dtype for v in t.weights_for_cache().values()} == {torch.bfloat16}


def test_lora_offload_empties_the_device_and_reload_restores_it(base: Path) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    allocated0 = torch.cuda.memory_allocated()
    t = _trainer(base)
    t.train_step(BATCH)
    before = {n: p.detach().to("cpu", copy=True) for n, p in t.model.named_parameters()}
    t.offload()
    assert torch.cuda.memory_allocated() - allocated0 < MiB
    t.reload()
    for n, p in t.model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p.cpu(), before[n]), n
    assert torch.isfinite(torch.tensor(t.train_step(BATCH)["loss"]))
