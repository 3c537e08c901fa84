"""A coordinator restarted on a journal that ends in garbage (a torn line, random bytes,
invalid UTF-8, a zeroed block, lines that are JSON but not objects) comes up with the
leases of every whole event, cuts the garbage off before appending, and a later
restart reads what it appended (docs/JOURNAL.md). Before, such a journal crashed the
coordinator on restart, and its launcher restarted it into the same crash forever.
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from pathlib import Path

import pytest
from helpers.cluster import joined_pipeline

from rlix_async.config import SchedulerConfig
from rlix_async.control import journal as ev
from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols import messages as m
from rlix_async.protocols.messages import DeviceOwner
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.security import ipc_endpoint
from rlix_async.transport import RpcClient

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {
    "A": {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
    "B": {"actor_train": ClusterSpec(1, (2, 3)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
    "C": {"actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
}
HISTORY: list[ev.Event] = [
    ev.Registered(pipeline="A", clusters=TOPO["A"], t=1.0),
    ev.Admitted(pipeline="A", t=2.0),
    ev.Granted(
        pipeline="A", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0, 1], t=3.0
    ),
    ev.Registered(pipeline="B", clusters=TOPO["B"], t=4.0),
    ev.Admitted(pipeline="B", t=5.0),
    ev.Expanded(pipeline="B", cluster="actor_infer", ranks=[2, 3], devices=[2, 3], t=6.0),
    ev.ProgressReported(pipeline="B", stream="default", target=64, completed=10, t=7.0),
]
TRAIN_A = DeviceOwner("A", "actor_train", "ACTOR_TRAINING")
LEASES = [TRAIN_A, TRAIN_A] + [DeviceOwner("B", "actor_infer", "GENERATION", r) for r in (2, 3)]
GARBAGE = {
    "torn": b'{"ev":"grant","pipeline":"B","t":8.0,"cluster":"actor_tr',
    "random": random.Random(16).randbytes(400),
    "invalid utf-8": b'{"ev":"admit","pipeline":"\xff\xfe"}\n\xe2\x98',
    "zeroed": b"\x00" * 4096,
    "not objects": b'[1,2]\n"str"\nnull\n',
}


def damaged_journal(tmp_path: Path, garbage: bytes) -> tuple[Path, bytes]:
    journal = tmp_path / "journal.jsonl"
    ev.write_journal(journal, HISTORY)
    whole = journal.read_bytes()
    journal.write_bytes(whole + garbage)
    return journal, whole


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=list(GARBAGE))
async def test_restarted_on_a_journal_ending_in_garbage_it_keeps_every_whole_events_leases(
    ipc_ep: str, tmp_path: Path, garbage: bytes
) -> None:
    journal, whole = damaged_journal(tmp_path, garbage)
    cfg = SchedulerConfig(lease_timeout_s=60)  # replayed pipelines keep their leases
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg) as co:
        assert co.registry.owners() == LEASES
        assert co.registry.pipelines["B"].remaining() == 54
        assert journal.read_bytes() == whole  # cut before anything was appended
        assert (tmp_path / "journal.jsonl.cut").read_bytes() == garbage
        c = await joined_pipeline(co.endpoint, "C", TOPO["C"])  # journals after the cut
        await c.close()
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg) as co:
        assert co.registry.owners()[:2] == [TRAIN_A, TRAIN_A]  # (B's ranks may be planned)
        assert co.registry.pipelines["C"].admitted
    events = list(ev.read_journal(journal))
    assert events[: len(HISTORY)] == HISTORY
    assert ev.Admitted(pipeline="C") in [ev.Admitted(pipeline=e.pipeline) for e in events]
    assert (tmp_path / "journal.jsonl.cut").read_bytes() == garbage  # nothing more cut


async def test_the_coordinator_process_comes_up_on_a_journal_ending_in_random_bytes(
    tmp_path: Path,
) -> None:
    """The process a launcher restarts: it must come up, not crash again and again."""
    journal, _ = damaged_journal(tmp_path, random.Random(1).randbytes(1000) + b"\xff\x00")
    endpoint = ipc_endpoint(f"jtest-{uuid.uuid4().hex[:8]}")
    log = tmp_path / "coordinator.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rlix_async.cli",
            "coordinator",
            f"endpoint={endpoint}",
            "cluster.gpus_per_node=4",
            f"journal={journal}",
            "scheduler.lease_timeout_s=60",
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
        )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            while not (line := await proc.stdout.readline()).startswith(b"READY"):
                if not line:
                    await proc.wait()
                    tail = log.read_text(errors="replace")[-3000:]
                    raise AssertionError(f"coordinator exited {proc.returncode}:\n{tail}")
        async with RpcClient(endpoint, f"probe-{uuid.uuid4().hex[:6]}/cli/0") as client:
            status = await client.call(m.StatusRequest(), timeout=10)
        assert isinstance(status, m.StatusReply)
        assert status.owners == LEASES
        assert "cut off 1002 bytes" in log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
