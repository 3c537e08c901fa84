"""`rlix-async models`: names, where models live, errors, and no second conversion.
The real conversion (a 98 MB GGUF, about 40 s) is tests/integration/test_pretrained_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cluster import ROOT, rlix

from rlix_async.models import pretrained
from rlix_async.models.pretrained import (
    KNOWN_MODELS,
    MARKER,
    KnownModel,
    ModelError,
    convert,
    converted,
    find_gguf,
    models_dir,
)


def test_models_live_under_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RLIX_ASYNC_CACHE", str(tmp_path))
    assert models_dir() == tmp_path / "models"
    monkeypatch.delenv("RLIX_ASYNC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models_dir() == tmp_path / ".cache" / "rlix_async" / "models"


def test_a_finished_directory_is_returned_without_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "_convert_into", never)
    name = "smollm2-135m-instruct"
    (tmp_path / name).mkdir()
    assert converted(name, tmp_path) is None  # no marker: an unfinished attempt
    (tmp_path / name / MARKER).write_text("{}")
    assert convert(name, tmp_path) == tmp_path / name


def test_an_interrupted_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(gguf: Path, model: KnownModel, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrained, "_convert_into", interrupted)
    monkeypatch.setattr(pretrained, "find_gguf", lambda model: tmp_path / "x.gguf")
    with pytest.raises(KeyboardInterrupt):
        convert("smollm2-135m-instruct", tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []
    assert converted("smollm2-135m-instruct", tmp_path / "models") is None


def test_a_missing_package_says_how_to_install_it() -> None:
    ghost = KnownModel("rlix-no-such-dist", "1.0", "x.gguf", "LlamaForCausalLM", "none")
    with pytest.raises(ModelError, match=r"not installed: run `bash scripts/setup.sh models`"):
        find_gguf(ghost)


def test_setup_pins_the_version_the_converter_expects() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for model in KNOWN_MODELS.values():
        assert f"--no-deps {model.distribution}=={model.version}" in setup


def test_cli_lists_models_and_refuses_unknown_ones(tmp_path: Path) -> None:
    name = "smollm2-135m-instruct"
    listed = rlix("models", "--dir", str(tmp_path), timeout=60)
    assert listed.returncode == 0 and name in listed.stdout and "not converted" in listed.stdout
    (tmp_path / name).mkdir()
    (tmp_path / name / MARKER).write_text(json.dumps({"name": name}))
    again = rlix("models", name, "--dir", str(tmp_path), timeout=60)
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == str(tmp_path / name)
    bad = rlix("models", "gpt-5", "--dir", str(tmp_path), timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: unknown model 'gpt-5'; known: smollm2-135m-instruct"
    ]
