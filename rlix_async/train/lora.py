"""LoRA adapters on a frozen base model, with peft (issue 21).

A LoRA pipeline trains only an adapter: ``lora_model`` wraps the HF model the
trainer loaded in a peft model whose base weights are frozen. Three forms of the
adapter leave the trainer:

- the weight cache (``adapter_for_cache``): peft's adapter state dict names, without
  the adapter name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
  ``[r, in]``, and ``...lora_B.weight``, ``[out, r]``), with ``lora_B`` already
  multiplied by alpha / r. The shards serve every adapter with ``lora_alpha = r``
  (scaling 1), so the scale travels inside the weights and the shards need not know
  each pipeline's alpha;
- checkpoints (``adapter_state``): the same names, unscaled (the training state),
  with ``record``: the base directory and LoRA config they were trained with, so
  ``rlix-async export`` can merge them (``merged_model``) without the pipeline's
  config;
- the merged model: ``merge_and_unload`` into a plain HF model, as export writes it.

The adapter's parameters (and so its optimizer state) are float32 whatever the
trainer's dtype, peft's default: an adapter is small, and its updates are far finer
than bf16's spacing around its weights. The base keeps the trainer's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch

if TYPE_CHECKING:  # the trainer imports this module; full-weight runs need no LoRA config
    from rlix_async.config.lora import LoraConfig

ADAPTER = "default"  # peft's name for a model's only adapter
_A, _B = ".lora_A.weight", ".lora_B.weight"
DTYPE_NAMES = ("bfloat16", "float32")  # the trainer's dtypes (train/precision.py DTYPES)


def lora_model(base: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """``base`` (an HF causal LM, in host memory) wrapped with a fresh adapter; only the
    adapter requires grad. The same seed gives the same adapter on every rank and
    every restart, whatever the RNG's state before."""
    import peft
    import transformers

    if not isinstance(base, transformers.PreTrainedModel):
        raise TypeError(
            f"LoRA trains an HF model (train.backend torch), not a {type(base).__name__}"
        )
    pcfg = peft.LoraConfig(
        r=cfg.rank,
        # typed int in peft, used as alpha / r: a float alpha works and means what it says
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        target_modules=list(cfg.target_modules),
        layers_to_transform=list(cfg.layers) if cfg.layers else None,
        lora_dropout=cfg.dropout,
        bias="none",  # the shards serve A and B only
        task_type="CAUSAL_LM",
    )
    # fork_rng: the adapter's init draws from a generator of its own, so building it
    # neither depends on nor shifts the trainer's RNG stream (CPU only: it is built there)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cast(torch.nn.Module, peft.get_peft_model(base, pcfg))


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: the adapter's on a LoRA model, all otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def frozen_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def base_only(model: torch.nn.Module) -> AbstractContextManager[None]:
    """The model with its adapter off: the base model's forward, on the same weights."""
    return cast(AbstractContextManager[None], cast(Any, model).disable_adapter())


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as it trains (unscaled), peft's names without the adapter name. The
    tensors are the parameters' own (no copy)."""
    import peft

    # save_embedding_layers=False: "auto" would look for the base's config.json (on
    # the hub if the path is not a directory) to see whether the vocabulary grew
    state = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
    odd = [k for k in state if not k.endswith((_A, _B))]
    if odd:  # a tuner we do not serve (bias, modules_to_save): the shards would drop it
        raise ValueError(f"adapter tensors the shards cannot serve: {odd[:3]}")
    return {k: v.detach() for k, v in state.items()}


def adapter_for_cache(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter as the shards load it: ``lora_B`` times its layer's scaling
    (alpha / r), every tensor contiguous in ``dtype``. Tensors that need no cast are
    views of the parameters, as the full-weight cache's are: the cache copies them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in adapter_state(model).items():
        if name.endswith(_B):
            # the layer's own scaling: what its forward multiplies by, whatever set it
            layer = model.get_submodule(name.removesuffix(_B))
            t = t * float(cast(Any, layer).scaling[ADAPTER])  # in float32, rounded once
        out[name] = t.to(dtype).contiguous()
    return out


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``state`` (from ``adapter_state``) copied into the model's adapter, every tensor
    accounted for (a missing one would leave that layer's adapter as it was)."""
    import peft

    want = adapter_state(model)
    missing, unexpected = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing or unexpected:
        raise ValueError(
            f"the adapter does not fit this model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    for name, t in want.items():  # torch's own message would name no tensor in its first line
        if state[name].shape != t.shape:
            raise ValueError(f"{name} is {list(state[name].shape)}, the model's {list(t.shape)}")
    with torch.no_grad():
        peft.set_peft_model_state_dict(model, dict(state))


def record(cfg: LoraConfig, base: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """What a checkpoint holds beside the adapter so that it can be merged alone: the
    base directory (absolute; None for the seeded tiny model), the LoRA config, the
    trainer's dtype. Plain values: ``torch.load(weights_only=True)`` reads them."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"trainer dtype {dtype}: expected one of {DTYPE_NAMES}")
    return {
        "base": str(Path(base).resolve()) if base else None,
        "config": msgspec.to_builtins(cfg),
        "dtype": name,
    }


def config_of(rec: Mapping[str, Any]) -> LoraConfig:
    """The LoRA config a checkpoint's ``record`` names (validated as the config is)."""
    from rlix_async.config.lora import LoraConfig

    return msgspec.convert(rec["config"], LoraConfig)


def same_adapter(a: LoraConfig, b: LoraConfig) -> bool:
    """Whether adapters of the two configs mean the same thing (dropout acts in
    training only; the order of targets and layers is no part of the adapter)."""

    def key(c: LoraConfig) -> tuple[int, float, list[str], list[int]]:
        return c.rank, c.alpha, sorted(c.target_modules), sorted(c.layers or [])  # []: all

    return key(a) == key(b)


def load_checkpoint_adapter(
    model: torch.nn.Module, cfg: LoraConfig | None, ckpt: Mapping[str, Any], path: Path
) -> None:
    """The adapter of checkpoint ``ckpt`` (read from ``path``) into ``model``, a LoRA
    model of ``cfg``; a full-weight checkpoint, or one of another adapter, is refused."""
    rec = ckpt.get("lora")
    if cfg is None:
        raise ValueError(f"{path}: a LoRA adapter checkpoint; this trainer trains all weights")
    if rec is None:
        raise ValueError(f"{path}: a full-weight checkpoint; this trainer trains a LoRA adapter")
    saved = config_of(rec)
    if not same_adapter(saved, cfg):
        raise ValueError(f"{path}: an adapter of {saved}; this trainer's is {cfg}")
    load_adapter_state(model, ckpt["model"])


def merged_model(
    base: str | Path, rec: Mapping[str, Any], state: Mapping[str, torch.Tensor]
) -> torch.nn.Module:
    """The model of the directory ``base`` with the adapter ``state`` merged into its
    weights: a plain HF model in the trainer's dtype (merged in float32, rounded once)."""
    from rlix_async.models.hf import load_hf_model

    dtype_name = rec.get("dtype")
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype_name!r}: expected one of {DTYPE_NAMES}")
    # any seed: the fresh adapter is overwritten by the checkpoint's
    peft_model = lora_model(load_hf_model(str(base), torch.float32), config_of(rec), seed=0)
    load_adapter_state(peft_model, state)
    merged = cast(Any, peft_model).merge_and_unload()
    return cast(torch.nn.Module, merged.to(getattr(torch, dtype_name)))
