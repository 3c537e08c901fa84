from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlix_async.security import ipc_endpoint

PEER = Path(__file__).with_name("peer.py")
TIERS = ("slow", "vllm", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plain `pytest` is the fast tier; slower tiers run when selected with -m."""
    if config.option.markexpr:
        return
    for item in items:
        for tier in TIERS:
            if tier in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{tier} tier: select with -m {tier}"))


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


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=10)


@pytest.fixture
def spawn(peers: list[Peer]):  # type: ignore[no-untyped-def]
    def _spawn(role: str, endpoint: str, *args: str) -> Peer:
        p = start_peer(role, endpoint, *args)
        peers.append(p)
        return p

    return _spawn


@pytest.fixture
def ipc_ep() -> str:
    return ipc_endpoint(f"test-{uuid.uuid4().hex[:10]}")


async def joined_pipeline(endpoint: str, pid: str, topology: dict, transport=None):  # type: ignore[no-untyped-def]
    """A pipeline driver that is connected, registered and admitted."""
    from rlix_async.control.client import PipelineClient

    pc = await PipelineClient.connect(endpoint, pipeline_id=pid, transport=transport)
    await pc.register(topology)
    await pc.admit()
    return pc
