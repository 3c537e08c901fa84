"""The control plane with real processes: a coordinator and three pipeline drivers.

Drivers use logical rollout shards (tests/helpers/pipeline_driver.py): the scheduling,
leases, journal and reconnection are the real ones.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlix_async.protocols import messages as m
from rlix_async.security import ipc_endpoint
from rlix_async.transport import RpcClient

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "helpers" / "pipeline_driver.py"
LEASE_S = 2.0
HB_S = 0.2


class Proc:
    """A child process whose stdout lines are collected by a thread."""

    def __init__(self, *cmd: str) -> None:
        self.p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not seen in {timeout}s; got {self.seen[-5:]}")
            try:
                self.seen.append(self.lines.get(timeout=min(left, 0.5)))
            except queue.Empty:
                if self.p.poll() is not None and self.lines.empty():
                    raise AssertionError(f"exited {self.p.returncode} before {text!r}") from None

    def kill9(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)


def coordinator(endpoint: str, journal: Path) -> Proc:
    proc = Proc(
        sys.executable,
        "-m",
        "rlix_async.cli",
        "coordinator",
        f"endpoint={endpoint}",
        "cluster.gpus_per_node=8",
        f"journal={journal}",
        f"scheduler.lease_timeout_s={LEASE_S}",
        f"heartbeat_interval_s={HB_S}",
        "scheduler.rebalance_s=0.5",
    )
    proc.wait_for(f"READY {endpoint}", 30)
    return proc


def driver(endpoint: str, pid: str, train: str, steps: int) -> Proc:
    return Proc(
        sys.executable,
        str(DRIVER),
        endpoint,
        "--id",
        pid,
        "--train",
        train,
        "--infer",
        "0-7",
        "--steps",
        str(steps),
        "--hb",
        str(HB_S),
    )


async def status(endpoint: str) -> m.StatusReply:
    async with RpcClient(endpoint, f"probe-{uuid.uuid4().hex[:6]}/cli/0") as c:
        reply = await c.call(m.StatusRequest(), timeout=10)
    assert isinstance(reply, m.StatusReply)
    return reply


@pytest.mark.slow
async def test_kill_a_driver_then_restart_the_coordinator(tmp_path: Path) -> None:
    endpoint = ipc_endpoint(f"itest-{uuid.uuid4().hex[:8]}")
    journal = tmp_path / "journal.jsonl"
    procs: list[Proc] = []
    try:
        coord = coordinator(endpoint, journal)
        procs.append(coord)
        a, b, c = (
            driver(endpoint, pid, train, steps)
            for pid, train, steps in (("A", "0,1", 14), ("B", "2,3", 14), ("C", "4,5", 200))
        )
        procs += [a, b, c]
        await asyncio.to_thread(c.wait_for, "STEP 1", 60)

        # kill -9 one driver mid-step: its leases go within the lease timeout
        killed = time.monotonic()
        c.kill9()
        while True:
            st = await status(endpoint)
            if "C" not in {p.id for p in st.pipelines} and not any(
                o is not None and o.pipeline == "C" for o in st.owners
            ):
                break
            assert time.monotonic() - killed < LEASE_S + 2.5 * HB_S + 2.0, st
            await asyncio.sleep(0.1)
        freed_after = time.monotonic() - killed
        assert freed_after <= LEASE_S + 2.5 * HB_S + 2.0

        # restart the coordinator mid-run: the others reconnect, resume and finish
        await asyncio.to_thread(a.wait_for, "STEP 3", 60)
        coord.kill9()
        await asyncio.sleep(0.5)
        coord = coordinator(endpoint, journal)
        procs.append(coord)
        await asyncio.to_thread(a.wait_for, "DONE", 120)
        await asyncio.to_thread(b.wait_for, "DONE", 120)
        assert a.p.wait(timeout=10) == 0 and b.p.wait(timeout=10) == 0
        st = await status(endpoint)
        assert st.pipelines == [] and st.rejected_plans == 0
        assert all(o is None for o in st.owners)
    finally:
        for p in procs:
            p.stop()

    # the journal covers the whole run, across the restart, and draws
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "rlix_async.cli",
            "timeline",
            str(journal),
            "-o",
            str(tmp_path / "timeline.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    events = journal.read_text()
    assert '"reason":"lease expired"' in events and events.count('"ev":"grant"') >= 20
