"""The torch trainer with ``lora`` (issue 21): a peft adapter on a frozen base directory.

A step changes the adapter only and the optimizer holds only it; the weight cache is
the adapter in the shards' format (peft's names, lora_B times alpha / r), which a
forward computed by hand from the base and those tensors reproduces; the KL reference
is the base model, without a second copy; checkpoints hold the adapter, not the base,
and resume bit-exactly; export merges the adapter into its base as a plain HF model.
Real model directories (the tiny Llama of helpers/tiny_text.py), float32 on the host."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from helpers.tiny_text import save_tiny_model  # noqa: E402

from rlix_async.config import LossConfig, ModelConfig, TorchTrainConfig  # noqa: E402
from rlix_async.config.lora import LORA_TARGETS, LoraConfig  # noqa: E402
from rlix_async.models.hf import load_hf_model  # noqa: E402
from rlix_async.models.tiny import save_tiny_llama  # noqa: E402
from rlix_async.protocols.batch import Group  # noqa: E402
from rlix_async.train import policy_update as trainer_module  # noqa: E402
from rlix_async.train.algo import policy_loss  # noqa: E402
from rlix_async.train.export import ExportError, export_checkpoint  # noqa: E402
from rlix_async.train.packing import pack_batch  # noqa: E402
from rlix_async.train.trainer import TorchTrainer  # noqa: E402

# alpha / rank = 4: a cache or merge that forgot the scale is off by a factor of 4
LORA = LoraConfig(rank=2, alpha=8.0)
SCALE = LORA.alpha / LORA.rank
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
BATCH = [
    Group([1, 2], [[3, 4, 5, 6], [9]], [[-3.0] * 4, [-3.0]], [[0] * 4, [0]], [1.0, 0.0]),
    Group(
        [5, 6], [[10, 11], [12, 13, 14]], [[-3.0] * 2, [-3.0] * 3], [[0] * 2, [0] * 3], [0.0, 1.0]
    ),
]
IDS = torch.tensor([[1, 5, 9, 12, 40, 7], [3, 3, 8, 200, 17, 2]])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama directory (2 layers, hidden 128, tied embeddings): the frozen base."""
    return save_tiny_model(tmp_path_factory.mktemp("lora") / "base", "llama", seed=0)


def lora_trainer(base: Path, seed: int = 0, lora: LoraConfig = LORA, **train: Any) -> TorchTrainer:
    cfg = TorchTrainConfig(dtype="float32", lr=1e-2, minibatches=1, **train)
    return TorchTrainer(cfg, ModelConfig(path=str(base)), seed=seed, lora=lora)


def adapter_params(t: TorchTrainer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in t.model.named_parameters() if ".lora_" in n}


def base_params(t: TorchTrainer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in t.model.named_parameters() if ".lora_" not in n}


def randomize_adapter(t: TorchTrainer, seed: int = 7) -> None:
    """Adapter weights far from the fresh adapter's (B is zero there, a no-op): the
    comparisons below then see every layer's adapter in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_params(t).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def shard_names(layers: int) -> set[str]:
    """The cache's names as the shard side expects them (written out here, not peft's)."""
    return {
        f"base_model.model.model.layers.{i}.{'self_attn' if m in ATTENTION else 'mlp'}"
        f".{m}.lora_{ab}.weight"
        for i in range(layers)
        for m in LORA_TARGETS
        for ab in "AB"
    }


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors_in(v)


def test_a_step_changes_only_the_adapter_and_the_optimizer_holds_only_it(base: Path) -> None:
    t = lora_trainer(base)
    adapter, frozen = adapter_params(t), base_params(t)
    assert len(adapter) == 2 * 2 * len(LORA_TARGETS)  # A and B, 2 layers, 7 targets
    assert all(p.requires_grad for p in adapter.values())
    assert not any(p.requires_grad for p in frozen.values())
    optimized = [p for g in t.optim.param_groups for p in g["params"]]
    assert len(optimized) == len(adapter)
    assert {id(p) for p in optimized} == {id(p) for p in adapter.values()}
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    for _ in range(2):  # the first moves only B (A's gradient is B's, zero at the start)
        stats = t.train_step(BATCH)
        assert stats["skipped_updates"] == 0 and stats["grad_norm"] > 0
    for n, p in frozen.items():
        assert torch.equal(p, before[n]), n
    for n, p in adapter.items():
        assert not torch.equal(p, before[n]), n
    state = t.optim.state
    assert {id(p) for p in state} == {id(p) for p in adapter.values()}
    moments = [v for s in state.values() for k, v in s.items() if k != "step"]
    assert sum(v.numel() for v in moments) == 2 * sum(p.numel() for p in adapter.values())


def test_an_adapter_on_the_last_layer_trains_there_and_backpropagates_no_further(
    base: Path,
) -> None:
    """``lora.layers``: adapters on those layers only, in the optimizer and the cache;
    layer 0 then computes nothing that needs a gradient (the backward stops at layer 1).
    With every layer adapted, layer 0's output does need one: the check can fail."""

    def layer0_needs_grad(t: TorchTrainer) -> bool:
        seen: list[bool] = []
        layer0 = t.model.get_submodule("base_model.model.model.layers.0")
        hook = layer0.register_forward_hook(
            lambda _m, _i, out: seen.append(next(tensors_in(out)).requires_grad)
        )
        try:
            stats = t.train_step(BATCH)
        finally:
            hook.remove()
        assert stats["skipped_updates"] == 0 and seen
        return any(seen)

    last = lora_trainer(base, lora=LoraConfig(rank=2, alpha=8.0, layers=[1]))
    assert {n.split(".layers.")[1].split(".")[0] for n in adapter_params(last)} == {"1"}
    assert {n for n in last.weights_for_cache()} == {n for n in shard_names(2) if ".layers.1." in n}
    assert not layer0_needs_grad(last)
    assert layer0_needs_grad(lora_trainer(base))


def test_a_checkpoint_resumes_only_into_the_same_adapted_layers() -> None:
    """``same_adapter`` (what a resume checks): the layers' order is no part of the
    adapter, the set is (every layer and two of them are different adapters)."""
    from rlix_async.train.lora import same_adapter

    assert same_adapter(LoraConfig(layers=[1, 0]), LoraConfig(layers=[0, 1]))
    assert not same_adapter(LoraConfig(layers=[1]), LoraConfig(layers=[0, 1]))
    assert not same_adapter(LoraConfig(layers=[1]), LoraConfig())


def test_the_cache_is_the_adapter_with_b_scaled_as_the_shards_serve_it(base: Path) -> None:
    t = lora_trainer(base)
    randomize_adapter(t)
    cache = t.weights_for_cache()
    assert set(cache) == shard_names(2)
    config = transformers.AutoConfig.from_pretrained(base)
    for name, w in cache.items():
        assert w.is_contiguous() and w.dtype == t.dtype, name
        param = adapter_params(t)[name.replace(".weight", ".default.weight")]
        if ".lora_A." in name:
            assert w.shape[0] == LORA.rank and torch.equal(w, param), name
        else:
            assert w.shape[1] == LORA.rank and torch.equal(w, param * SCALE), name
    assert cache["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (
        LORA.rank,
        config.intermediate_size,
    )

    # the shards' forward, by hand: base linear + x A^T B^T (scale 1, B carries it)
    plain = load_hf_model(str(base), torch.float32)
    for name, mod in plain.named_modules():
        key = f"base_model.model.{name}"
        if f"{key}.lora_A.weight" in cache:
            a, b = cache[f"{key}.lora_A.weight"], cache[f"{key}.lora_B.weight"]
            mod.register_forward_hook(lambda _m, i, out, a=a, b=b: out + i[0] @ a.T @ b.T)
    assert torch.allclose(logits(plain), logits(t.model), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(load_hf_model(str(base), torch.float32)), logits(t.model))


def test_bfloat16_keeps_the_base_in_bf16_the_adapter_in_float32_the_cache_in_bf16(
    base: Path,
) -> None:
    t = TorchTrainer(TorchTrainConfig(dtype="bfloat16"), ModelConfig(path=str(base)), lora=LORA)
    assert {p.dtype for p in base_params(t).values()} == {torch.bfloat16}
    assert {p.dtype for p in adapter_params(t).values()} == {torch.float32}
    stats = t.train_step(BATCH)
    assert stats["skipped_updates"] == 0
    state = [v for s in t.optim.state.values() for k, v in s.items() if k != "step"]
    assert state and {v.dtype for v in state} == {torch.float32}
    assert {v.dtype for v in t.weights_for_cache().values()} == {torch.bfloat16}


def test_the_kl_reference_is_the_base_model_with_no_second_copy(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = lora_trainer(base, loss=LossConfig(kl_coef=0.1))
    assert t.reference is None and t.has_reference
    randomize_adapter(t)  # the policy is not the base from the first step
    seen: list[torch.Tensor] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["ref_logp"].detach().clone())
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    packed = pack_batch(BATCH, 0, 1)
    ids, width = packed["ids"], packed["mask"].shape[1]  # the response positions
    with torch.no_grad():
        policy = t.logp(t.model.eval(), ids, width)
        want = t.logp(load_hf_model(str(base), torch.float32).eval(), ids, width)
    stats = t.train_step(BATCH)
    (ref,) = seen
    # The reference pass runs the base's float32 ops on a minibatch, `want` on the whole
    # batch: BLAS may sum in another order for other shapes (it did on a loaded host).
    # Each of the path's R reductions (length at most K) then differs by about sqrt(K)
    # roundings of eps relative to what it sums, and log-softmax at most doubles a
    # logit's error: the bound, scaled by the largest log-prob.
    r, k = 2 * 7 + 1, 256  # per layer: q/k/v, scores, softmax, attn@v, o, gate/up, down; + head
    eps = torch.finfo(torch.float32).eps
    atol = 2 * r * k**0.5 * eps * float(want.abs().max())
    assert torch.allclose(ref, want, atol=atol, rtol=0), (ref - want).abs().max()
    # the adapter was off, not on: switched on, it moves the log-probs by far more
    assert float((ref - policy).abs().max()) > 100 * atol
    assert stats["kl"] > 0
    # the adapter is back on after the reference pass: the step trained the policy
    assert not torch.allclose(logits(t.model), logits(load_hf_model(str(base), torch.float32)))


def test_pi_old_is_the_adapter_without_dropout(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ratios divide by pi_old: with adapter dropout it is the model in eval mode,
    not one dropout draw (the update itself trains with dropout)."""
    t = lora_trainer(base, lora=LoraConfig(rank=2, alpha=8.0, dropout=0.5))
    randomize_adapter(t)
    seen: list[torch.Tensor] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[1].detach().clone())
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    packed = pack_batch(BATCH, 0, 1)
    with torch.no_grad():
        want = t.logp(t.model.eval(), packed["ids"], packed["mask"].shape[1])
    t.train_step(BATCH)
    assert torch.equal(seen[0], want)
    assert t.model.training  # the update ran in train mode


def test_an_adapter_checkpoint_holds_no_base_and_resumes_bit_exactly(
    base: Path, tmp_path: Path
) -> None:
    a = lora_trainer(base, seed=0)
    for _ in range(2):
        a.train_step(BATCH)
    path = tmp_path / "ckpt" / "step_2.pt"
    a.save(path, {"prompts_used": 7})

    ckpt = torch.load(path, weights_only=True)
    adapter_numel = sum(p.numel() for p in adapter_params(a).values())
    assert set(ckpt["model"]) == shard_names(2)  # peft's names: no base tensor
    assert sum(v.numel() for v in ckpt["model"].values()) == adapter_numel
    floats = [v for v in tensors_in(ckpt) if v.is_floating_point()]
    # adapter + AdamW's two moments (+ the optimizer's step counters): nothing else
    assert sum(v.numel() for v in floats if v.dim()) == 3 * adapter_numel
    base_bytes = sum(p.numel() * p.element_size() for p in base_params(a).values())
    size = path.stat().st_size
    assert size < 3 * 4 * adapter_numel + (48 << 10) < base_bytes / 4, (size, adapter_numel)
    assert ckpt["lora"] == {
        "base": str(base.resolve()),
        "config": {
            "rank": 2,
            "alpha": 8.0,
            "target_modules": list(LORA_TARGETS),
            "dropout": 0.0,
            "layers": None,
        },
        "dtype": "float32",
    }
    assert ckpt["prompts_used"] == 7

    b = lora_trainer(base, seed=1)  # another adapter init: the load must replace it
    assert not all(torch.equal(p, adapter_params(a)[n]) for n, p in adapter_params(b).items())
    assert b.load(path)["prompts_used"] == 7 and b.step == 2
    later = [BATCH[1], BATCH[0]]
    assert a.train_step(later) == b.train_step(later)  # the next step's loss, bit for bit
    for n, p in adapter_params(b).items():
        assert torch.equal(p, adapter_params(a)[n]), n

    with pytest.raises(ValueError, match="a LoRA adapter checkpoint; this trainer trains all"):
        TorchTrainer(TorchTrainConfig(), ModelConfig(path=str(base))).load(path)
    a_full = TorchTrainer(TorchTrainConfig(), ModelConfig(path=str(base)))
    a_full.save(tmp_path / "full.pt", {})
    with pytest.raises(ValueError, match="a full-weight checkpoint; this trainer trains a LoRA"):
        lora_trainer(base).load(tmp_path / "full.pt")
    with pytest.raises(ValueError, match="an adapter of"):  # same shapes, another scale
        lora_trainer(base, lora=LoraConfig(rank=2, alpha=2.0)).load(path)


def test_offload_and_reload_keep_the_adapter_trainer_as_it_was(base: Path, tmp_path: Path) -> None:
    """On a CUDA machine the frozen base, the adapter and its optimizer state all leave
    the device and come back; on the host offload is a no-op and the checks still hold."""
    cycled, straight = lora_trainer(base), lora_trainer(base)
    host = cycled.device.type == "cpu"
    for _ in range(2):
        stats, reference = cycled.train_step(BATCH), straight.train_step(BATCH)
        if host:
            assert stats == reference
        before = {n: p.detach().to("cpu", copy=True) for n, p in cycled.model.named_parameters()}
        cycled.offload()
        cached = cycled.weights_for_cache()  # as the pipeline publishes: after the offload
        cycled.save(tmp_path / "offloaded.pt", {})
        cycled.reload()
        for n, p in cycled.model.named_parameters():
            assert torch.equal(p.cpu(), before[n]), n
        assert set(cached) == shard_names(2)
    fresh = lora_trainer(base, seed=3)
    fresh.load(tmp_path / "offloaded.pt")
    for n, p in adapter_params(fresh).items():
        assert torch.equal(p.cpu(), adapter_params(cycled)[n].cpu()), n


def test_export_merges_the_adapter_into_its_base(base: Path, tmp_path: Path) -> None:
    t = lora_trainer(base)
    t.train_step(BATCH)
    randomize_adapter(t)  # a strong adapter: a merge that dropped a layer would show
    ckpt = tmp_path / "out" / "exp" / "ckpt" / "step_1.pt"
    t.save(ckpt, {})
    # no pipeline.yaml beside it: the checkpoint names its base
    assert export_checkpoint(ckpt, tmp_path / "hf") == tmp_path / "hf"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert merged.dtype == torch.float32
    assert set(merged.state_dict()) == set(load_hf_model(str(base), torch.float32).state_dict())
    # merged, W + s B A rounds once per weight: float32 noise on logits of about 13,
    # where a merge that missed a layer or the scale is off by whole units
    assert torch.allclose(logits(merged), logits(t.model), atol=3e-4, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template

    # a base moved since training: gone, then named through the pipeline's config
    moved = tmp_path / "moved"
    os.rename(base, moved)
    try:
        with pytest.raises(ExportError, match="the base model directory is gone"):
            export_checkpoint(ckpt, tmp_path / "hf2")
        config = tmp_path / "pipeline.yaml"
        config.write_text(PIPELINE.format(model=moved))
        export_checkpoint(ckpt, tmp_path / "hf2", config=config)
    finally:
        os.rename(moved, base)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert torch.allclose(logits(again), logits(t.model), atol=3e-4, rtol=0)
    # a base the adapter does not fit: one line naming the checkpoint and the base
    other = save_tiny_llama(tmp_path / "other", 0, vocab_size=320, layers=2, hidden=64)
    config.write_text(PIPELINE.format(model=other))
    with pytest.raises(ExportError) as err:
        export_checkpoint(ckpt, tmp_path / "hf3", config=config)
    assert "its adapter does not fit" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "hf3").exists()


PIPELINE = """
id: exp
model: {{path: {model}}}
clusters:
  actor_train: {{tp: 1, devices: [0]}}
  actor_infer: {{tp: 1, devices: [0]}}
"""

TWO_RANKS = r"""
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from lora_case import BATCH, LORA
from rlix_async.config import ModelConfig, TorchTrainConfig
from rlix_async.train.trainer import TorchTrainer
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
t = TorchTrainer(TorchTrainConfig(dtype="float32", lr=1e-2, minibatches=1), ModelConfig(path=sys.argv[3]),
                 seed=rank, rank=rank, world=world, lora=LORA)  # seeds differ: DDP syncs the adapter
norms = []
for _ in range(2):
    t.init_group(store)
    norms.append(t.train_step(BATCH)["grad_norm"])
    t.destroy_group()
torch.save({"norms": norms, "cache": t.weights_for_cache(),
            "base": {n: p for n, p in t.model.named_parameters() if not p.requires_grad}},
           f"{sys.argv[1]}/rank{rank}.pt")
"""


@pytest.mark.slow
@pytest.mark.beside_heavy  # torchrun or in-process trainers: no heartbeats
@pytest.mark.timeout(300)
def test_two_ranks_train_one_adapter_as_one_rank_does(base: Path, tmp_path: Path) -> None:
    """DDP (gloo) over the adapter alone: both ranks end with the same adapter, the one
    a single rank trains on the whole batch, and the base untouched."""
    (tmp_path / "lora_case.py").write_text(
        "from rlix_async.config.lora import LoraConfig\n"
        "from rlix_async.protocols.batch import Group\n"
        f"LORA = LoraConfig(rank={LORA.rank}, alpha={LORA.alpha})\nBATCH = {BATCH!r}\n"
    )
    (tmp_path / "run.py").write_text(TWO_RANKS)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *(str(tmp_path / "run.py"), str(tmp_path), str(tmp_path), str(base)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    alone = lora_trainer(base, seed=0)
    norms = [alone.train_step(BATCH)["grad_norm"] for _ in range(2)]
    want = alone.weights_for_cache()
    plain = load_hf_model(str(base), torch.float32).state_dict()
    for r in ranks:
        assert r["norms"] == pytest.approx(norms, rel=1e-4)
        assert r["cache"].keys() == want.keys()
        for n, w in want.items():
            assert torch.equal(r["cache"][n], ranks[0]["cache"][n]), n
            # Adam scales each entry's step to about lr (1e-2): small gradients' float
            # noise shows as ~2e-5 here; a rank that trained on its half alone, ~1e-2
            assert torch.allclose(r["cache"][n], w, atol=2e-4, rtol=0), n
        for n, p in r["base"].items():
            assert torch.equal(
                p, plain[n.removeprefix("base_model.model.").replace(".base_layer", "")]
            ), n
