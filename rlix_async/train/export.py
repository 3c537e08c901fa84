"""``rlix-async export CKPT --hf DIR``: a pipeline checkpoint as a Hugging Face directory.

The trained policy leaves the run as a directory transformers and vLLM load as they
load any model: the weights of checkpoint ``OUT/<id>/ckpt/step_N.pt`` in the base
model's architecture and config, with the base model's tokenizer, chat template and
generation config. The base model is the pipeline's ``model.path`` (or the random
tiny Llama the launcher wrote to ``OUT/<id>/model``), read from the
``pipeline.yaml`` the launcher wrote next to the checkpoints. The checkpoint is read
with ``weights_only``: a file we did not write cannot run code as it is read.

A LoRA checkpoint holds the adapter alone and records its base directory and LoRA
config (train/lora.py): export merges the adapter into that base and writes the
merged model, a plain HF directory. Its base is the one it recorded, or, with
``--config``, that pipeline's ``model.path`` (a base moved since training).

A megatron-backend checkpoint holds the model in Megatron's names: whole in a
``step_N.pt`` file, or, from a model-parallel trainer, in a sharded ``step_N/``
directory of per-rank parts at any tensor x pipeline layout (train/sharded_checkpoint.py),
which export assembles. Either is converted to the base's HF Llama names (the fused
qkv split per query group, the fused gate/up split).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from rlix_async.config import MegatronTrainConfig, TorchTrainConfig, TrainConfig


class ExportError(ValueError):
    """A checkpoint that cannot be exported: one line, exit code 2."""


def export_checkpoint(ckpt: Path, hf_dir: Path, *, config: Path | None = None) -> Path:
    """Write the policy of ``ckpt`` to ``hf_dir`` (created; must not hold a model yet)."""
    import torch

    from rlix_async.train.sharded_checkpoint import CheckpointError, ShardedCheckpoint

    if ckpt.is_dir():
        try:
            state, lora = ShardedCheckpoint(ckpt).full_model(), None
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None
    elif not ckpt.is_file():
        raise ExportError(f"{ckpt}: no such checkpoint")
    else:
        try:
            data = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
            state, lora = data["model"], data.get("lora")
            if lora is not None and not isinstance(lora, dict):
                raise TypeError("lora")
        except Exception as exc:  # a torn or foreign file: say which, in one line
            why = type(exc).__name__
            raise ExportError(f"{ckpt}: not a pipeline checkpoint ({why})") from None
    run_dir = ckpt.resolve().parent.parent  # OUT/<id>/ckpt/step_N[.pt]
    train: TrainConfig = TorchTrainConfig()  # an adapter's: trained by the torch backend
    if lora is not None and config is None and lora.get("base"):
        base = Path(lora["base"])  # an adapter names its base: no pipeline config needed
    else:
        base, train = _base_from_config(config or run_dir / "pipeline.yaml", run_dir)
    if not (base / "config.json").is_file():
        raise ExportError(f"{base}: the base model directory is gone (config.json missing)")
    if ckpt.is_dir() and isinstance(train, TorchTrainConfig):  # only megatron writes them
        train = MegatronTrainConfig()
    state = _hf_names(ckpt, base, state, train)
    if (hf_dir / "config.json").exists():
        raise ExportError(f"{hf_dir}: already holds a model; choose an empty directory")
    model = _merged(ckpt, base, lora, state) if lora is not None else _full(ckpt, base, state)
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = hf_dir.with_name(f".{hf_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        for name in base.iterdir():  # the tokenizer, its chat template, the generation config
            if name.is_file() and _beside_weights(name.name) and not (tmp / name.name).exists():
                shutil.copy2(name, tmp / name.name)
        if hf_dir.exists():
            hf_dir.rmdir()  # empty: a model there was refused above; rmdir refuses the rest
        os.replace(tmp, hf_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return hf_dir


def _base_from_config(config: Path, run_dir: Path) -> tuple[Path, TrainConfig]:
    """The base model directory of the pipeline config ``config``, and its trainer."""
    from rlix_async.config import ConfigError, PipelineConfig, load_config

    if not config.is_file():
        raise ExportError(f"{config}: no pipeline config beside the checkpoint (use --config)")
    try:
        cfg = load_config(str(config), PipelineConfig)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    base = Path(cfg.model.path) if cfg.model.path else run_dir / "model"
    return base, cfg.train


def _hf_names(ckpt: Path, base: Path, state: dict[str, Any], train: TrainConfig) -> dict[str, Any]:
    """A checkpoint's model in the base's HF names, as its trainer backend says."""
    from rlix_async.train.backends import trainer_backend

    try:
        return trainer_backend(train).hf_state(state, base)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ExportError(f"{ckpt}: not a {train.backend} checkpoint of {base} ({exc})") from None


def _full(ckpt: Path, base: Path, state: dict[str, Any]) -> Any:
    """The base's architecture holding the checkpoint's weights, in their dtype."""
    import transformers

    from rlix_async.train.megatron_moe import fuse_experts

    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    # transformers holds a MoE layer's experts fused; a checkpoint may name them one by one
    state = fuse_experts(state, set(model.state_dict()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise ExportError(
            f"{ckpt}: does not fit {base} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return model


def _merged(ckpt: Path, base: Path, lora: dict[str, Any], state: dict[str, Any]) -> Any:
    """A LoRA checkpoint's adapter merged into its base: a plain model vLLM and
    transformers load without peft, in the dtype the adapter was trained at."""
    import msgspec

    from rlix_async.train.lora import merged_model

    try:
        return merged_model(base, lora, state)
    except (ValueError, RuntimeError, KeyError, msgspec.ValidationError) as exc:
        # a shape mismatch's message runs over many lines: its first says which tensor
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{ckpt}: its adapter does not fit {base} ({why})") from None


def _beside_weights(name: str) -> bool:
    """Files of the base directory that describe text, not weights (a sharded base's
    index or .bin files would point at shards the export does not have)."""
    return name.startswith(
        ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges")
    ) or name in ("chat_template.jinja", "chat_template.json", "generation_config.json")
