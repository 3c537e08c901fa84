from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def rlix(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_subcommands() -> None:
    out = rlix("--help")
    assert out.returncode == 0
    for cmd in ("keygen", "bench"):
        assert cmd in out.stdout


def test_keygen(tmp_path: Path) -> None:
    out = rlix("keygen", str(tmp_path / "keys"), "--client", "node1")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "keys" / "authorized" / "node1.key").exists()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_bench_rpc_json(transport: str) -> None:
    out = rlix("bench", "rpc", "--transport", transport, "--calls", "300", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["p50_us"] > 0 and result["p99_us"] >= result["p50_us"]
    assert result["throughput_rps"] > 100
    if transport == "ipc":  # the floors are timed in the same rounds
        for floor in ("zmq_floor", "asyncio_floor"):
            assert result[f"{floor}_p99_us"] >= result[f"{floor}_p50_us"] > 0


def test_bench_rpc_pinned() -> None:
    """--pin shared puts client and server on one CPU (the placement PERF.md quotes)."""
    out = rlix("bench", "rpc", "--pin", "shared", "--calls", "300", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["pin"] == "shared"
    assert result["client_cpus"] == result["server_cpus"] and len(result["server_cpus"]) == 1
    assert result["p99_us"] >= result["p50_us"] > 0
