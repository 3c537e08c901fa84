"""The multinode tier's launcher helpers: ``rlix-async launch --node K`` on a namespace
host (tests/helpers/hosts.py), and what a run wrote (metrics, journal, logs) read back
while it runs."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import Popen
from typing import Any

import pytest

from helpers.hosts import Hosts

CLI = [sys.executable, "-m", "rlix_async.cli"]


def launch_on(
    hosts: Hosts, k: int, cfg: Path, keys: Path, job: str, *extra: str, port: int = 7611
) -> Popen[bytes]:
    """Host ``k``'s launcher, as each machine of a cluster runs it, its coordinator on
    host 0 (log: launch-K.log beside the config)."""
    argv = [
        *CLI, "launch", str(cfg), "--node", str(k),
        "--coordinator", f"tcp://{hosts[0].address}:{port}",
        "--address", hosts[k].address, "--keys", str(keys), "--job", job, *extra,
    ]  # fmt: skip
    return hosts.start(hosts[k], argv, cfg.parent / f"launch-{k}.log")


def metrics(out: Path, pid: str) -> list[dict[str, Any]]:
    path = out / pid / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def journal(out: Path) -> list[dict[str, Any]]:
    """The coordinator's journal so far (a line being written is left out)."""
    path = out / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def logs(root: Path) -> str:
    """Every launcher's and process's log tail under ``root``: a failure's context."""
    parts = []
    for path in sorted([*root.glob("launch-*.log"), *(root / "out" / "logs").glob("*")]):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


def wait_for(
    what: str,
    until: Callable[[], object],
    root: Path,
    live: Sequence[Popen[bytes]] = (),
    timeout: float = 300,
    hosts: Hosts | None = None,
) -> None:
    """Until ``until()``; fails at once if a launcher in ``live`` has ended."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            stacks = "\n".join(hosts.stacks()) if hosts is not None else ""
            pytest.fail(f"timed out waiting for {what}\n{logs(root)}\n{stacks}")
        ended = [p.poll() for p in live if p.poll() is not None]
        assert not ended, f"a launcher ended ({ended}) waiting for {what}\n{logs(root)}"
        time.sleep(1)
