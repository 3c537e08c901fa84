"""An HF causal-LM directory as a torch model (the trainers' and the exporters' way in)."""

from __future__ import annotations

import torch


def load_hf_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """An HF causal-LM directory's model, its parameters in ``dtype``."""
    import transformers
    from packaging.version import Version

    # transformers 4.56 renamed torch_dtype (kept, with a warning, in 5.x)
    new = Version(transformers.__version__) >= Version("4.56")
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(
        path, **{"dtype" if new else "torch_dtype": dtype}
    )
    return model
