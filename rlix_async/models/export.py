"""``rlix-async export CKPT --hf DIR``: a pipeline checkpoint as a Hugging Face directory.

The trained policy leaves the run as a directory transformers and vLLM load as they
load any model: the weights of checkpoint ``OUT/<id>/ckpt/step_N.pt`` in the base
model's architecture and config, with the base model's tokenizer, chat template and
generation config. The base model is the pipeline's ``model.path`` (or the random
tiny Llama the launcher wrote to ``OUT/<id>/model``), read from the
``pipeline.yaml`` the launcher wrote next to the checkpoints. The checkpoint is read
with ``weights_only``: a file we did not write cannot run code as it is read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class ExportError(ValueError):
    """A checkpoint that cannot be exported: one line, exit code 2."""


def export_checkpoint(ckpt: Path, hf_dir: Path, *, config: Path | None = None) -> Path:
    """Write the policy of ``ckpt`` to ``hf_dir`` (created; must not hold a model yet)."""
    import torch

    from rlix_async.config import ConfigError, PipelineConfig, load_config

    if not ckpt.is_file():
        raise ExportError(f"{ckpt}: no such checkpoint")
    run_dir = ckpt.resolve().parent.parent  # OUT/<id>/ckpt/step_N.pt
    config = config or run_dir / "pipeline.yaml"
    if not config.is_file():
        raise ExportError(f"{config}: no pipeline config beside the checkpoint (use --config)")
    try:
        cfg = load_config(str(config), PipelineConfig)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    if cfg.train.backend != "torch":
        raise ExportError(
            f"{ckpt}: a {cfg.train.backend} checkpoint; export reads torch-backend "
            "checkpoints (HF names) only"
        )
    base = Path(cfg.model.path) if cfg.model.path else run_dir / "model"
    if not (base / "config.json").is_file():
        raise ExportError(f"{base}: the base model directory is gone (config.json missing)")
    if (hf_dir / "config.json").exists():
        raise ExportError(f"{hf_dir}: already holds a model; choose an empty directory")
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["model"]
    except Exception as exc:  # a torn or foreign file: say which, in one line
        raise ExportError(f"{ckpt}: not a pipeline checkpoint ({type(exc).__name__})") from None

    import transformers

    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise ExportError(
            f"{ckpt}: does not fit {base} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
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


def _beside_weights(name: str) -> bool:
    """Files of the base directory that describe text, not weights (a sharded base's
    index or .bin files would point at shards the export does not have)."""
    return name.startswith(
        ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges")
    ) or name in ("chat_template.jinja", "chat_template.json", "generation_config.json")
