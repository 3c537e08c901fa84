"""Helpers shared by the integration tests: peer processes and joined pipeline drivers."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
PEER = HELPERS / "peer.py"
SCRIPTED_ENGINE = f"{HELPERS / 'scripted_engine.py'}:ScriptedEngine"


@dataclass
class Peer:
    proc: subprocess.Popen[str]
    endpoint: str

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_peer(role: str, endpoint: str, *args: str, timeout: float = 30.0) -> Peer:
    proc = subprocess.Popen(
        [sys.executable, str(PEER), role, endpoint, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("READY"):
                return Peer(proc, line.split()[1])
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise RuntimeError(f"peer {role} did not start (exit code {proc.poll()})")


async def joined_pipeline(endpoint: str, pid: str, topology: dict, transport: Any = None):  # type: ignore[no-untyped-def]
    """A pipeline driver that is connected, registered and admitted."""
    from rlix_async.control.client import PipelineClient

    pc = await PipelineClient.connect(endpoint, pipeline_id=pid, transport=transport)
    await pc.register(topology)
    await pc.admit()
    return pc


def rlix(
    *args: str, timeout: float = 120, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``rlix-async`` command in a child process (``env``: its whole environment)."""
    return subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        cwd=ROOT,
        env=env,
    )
