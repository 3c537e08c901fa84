"""Recipes that ship with the package: a YAML (copy it to start your own) and the code
that writes its dataset. ``rlix-async demo --recipe NAME`` runs one end to end."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any


def _arithmetic_data(out: Path) -> None:
    from rlix_async.recipes.arithmetic import write_data

    write_data(out)


def _agent_data(out: Path) -> None:
    from rlix_async.recipes.arithmetic_agent import write_data

    write_data(out)


def _time_sharing_data(out: Path) -> None:
    """The main demo's two pipelines: each recipe's data in its own directory."""
    _arithmetic_data(out / "arithmetic")
    _agent_data(out / "arithmetic_agent")


def _calculator_data(out: Path) -> None:
    from rlix_async.recipes.calculator import write_data

    write_data(out)


def _guess_data(out: Path) -> None:
    from rlix_async.recipes.guess import write_data

    write_data(out)


def _no_data(out: Path) -> None:
    """A token-id task: its prompts are made as it runs."""


def _tiny_moe(out: Path) -> None:
    from rlix_async.models.tiny import save_tiny_qwen3_moe

    save_tiny_qwen3_moe(out, seed=0)


# Models a recipe makes locally (random, tiny), by name: what writes one into a directory
LOCAL_MODELS: dict[str, Callable[[Path], None]] = {"tiny-qwen3-moe": _tiny_moe}

# name: (its YAML in this package, the model it trains: converted or made locally, what
# writes its data)
RECIPES: dict[str, tuple[str, str, Callable[[Path], None]]] = {
    "arithmetic": ("arithmetic.yaml", "smollm2-135m-instruct", _arithmetic_data),
    "arithmetic_agent": ("arithmetic_agent.yaml", "smollm2-135m-instruct", _agent_data),
    "calculator": ("calculator.yaml", "smollm2-135m-instruct", _calculator_data),
    "calculator_api": ("calculator_api.yaml", "smollm2-135m-instruct", _calculator_data),
    "guess": ("guess.yaml", "smollm2-135m-instruct", _guess_data),
    # the main demo: arithmetic and arithmetic_agent as two pipelines time-sharing
    "time_sharing": ("time_sharing.yaml", "smollm2-135m-instruct", _time_sharing_data),
    # a mixture-of-experts policy at expert parallel 2, routes replayed
    "tiny_moe": ("tiny_moe.yaml", "tiny-qwen3-moe", _no_data),
}


def recipe_raw(name: str) -> dict[str, Any]:
    """The recipe's YAML as a plain dict (KeyError for an unknown name)."""
    from rlix_async.config.loading import read_yaml

    yaml_name = RECIPES[name][0]
    raw: dict[str, Any] = read_yaml(files(__name__).joinpath(yaml_name).read_text())
    return raw


def prepare_recipe(
    name: str, out: str, log: Callable[[str], None] = lambda _: None
) -> tuple[dict[str, Any], Path]:
    """Write the recipe's data under ``out/data`` and convert its model (once; later
    calls find it). Returns the recipe's YAML as a dict with ``out``, the data paths
    (the YAML's, relative to ``out``: ``data/...``) and ``model.path`` filled in, and
    the model's directory."""
    from rlix_async.models.pretrained import convert as convert_model
    from rlix_async.models.pretrained import models_dir

    _, model_name, write = RECIPES[name]
    data = Path(out) / "data"
    write(data)
    if model_name in LOCAL_MODELS:
        model = models_dir() / model_name
        if not (model / "config.json").is_file():
            log(f"making {model_name} in {model}")
            # whole or not at all: a run killed mid-write leaves no half model behind
            staging = model.with_name(f".{model_name}.{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            LOCAL_MODELS[model_name](staging)
            shutil.rmtree(model, ignore_errors=True)
            os.replace(staging, model)
    else:
        model = convert_model(model_name, log=log)
    raw = recipe_raw(name)
    raw["out"] = out
    for p in raw["pipelines"]:
        p["model"] = {**p.get("model", {}), "path": str(model)}
        d = p.get("data", {})
        for split in ("train", "eval"):  # the YAML's data/... paths, under out
            if d.get(split) and not Path(d[split]).is_absolute():
                d[split] = str(Path(out) / d[split])
    return raw, model
