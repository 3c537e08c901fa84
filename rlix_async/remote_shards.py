"""``launch --node K``: a trainer whose pipeline's shards run on other nodes starts once
they have joined the coordinator, as the one-node launcher starts trainers once its own
shards are ready. Without the wait a short run can finish before a slow engine on
another node joined (its shards' starts are minutes on a loaded host), and a longer one
begins on part of its rollout capacity.

Which shards: :func:`remote_shards` reads the whole plan (every node's processes);
whether they joined: the coordinator's status (``StatusReply.workers``, the shard
workers connected now), asked with this node's keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

from rlix_async.config import ShardConfig
from rlix_async.placement import PlacedProcess
from rlix_async.protocols import messages as m
from rlix_async.security import ClientKeys
from rlix_async.transport import RpcClient

log = logging.getLogger(__name__)
POLL_S = 1.0


def remote_shards(plan: list[PlacedProcess], node: int) -> dict[str, set[int]]:
    """Per shard owner (a pipeline, or a LoRA base group), the ranks of its shards on
    other nodes than ``node`` that serve a pipeline whose trainer's rank 0 (its driver)
    runs on ``node``: what this node's launcher waits for before starting trainers."""
    drivers = {
        p.pipeline
        for p in plan
        if p.role == "trainer" and p.node == node and p.first_rank == 0 and p.pipeline
    }
    wanted: dict[str, set[int]] = {}
    for p in plan:
        if p.role != "shard" or p.node == node or not isinstance(p.config, ShardConfig):
            continue
        served = p.config.members or [p.config.pipeline]
        if drivers.intersection(served):
            wanted.setdefault(p.config.pipeline, set()).add(p.config.rank)
    return wanted


def wait_remote_shards(
    wanted: dict[str, set[int]], endpoint: str, keys_dir: str | None, timeout_s: float
) -> None:
    """Until every shard in ``wanted`` is connected to the coordinator at ``endpoint``.
    RuntimeError (one line naming the missing ones) after ``timeout_s``."""
    if not wanted:
        return
    keys = ClientKeys.load(Path(keys_dir)) if keys_dir else None
    missing = asyncio.run(_wait(wanted, endpoint, keys, timeout_s))
    if missing:
        names = ", ".join(f"{pid}/{rank}" for pid, rank in missing)
        raise RuntimeError(
            f"shards on other nodes not joined after {timeout_s:.0f}s: {names} (is their "
            "node's `launch --node` running?)"
        )


async def _wait(
    wanted: dict[str, set[int]], endpoint: str, keys: ClientKeys | None, timeout_s: float
) -> list[tuple[str, int]]:
    deadline = time.monotonic() + timeout_s
    missing = sorted((pid, rank) for pid, ranks in wanted.items() for rank in ranks)
    said = False
    async with RpcClient(endpoint, f"launch-{uuid.uuid4().hex[:6]}/cli/0", keys=keys) as client:
        while time.monotonic() < deadline:
            try:
                reply = await client.call(m.StatusRequest(), timeout=10)
            except Exception as exc:  # the coordinator (re)starting: asked again
                log.debug("status: %s", exc)
                reply = None
            if isinstance(reply, m.StatusReply):
                missing = [
                    (pid, rank) for pid, rank in missing if rank not in reply.workers.get(pid, [])
                ]
                if not missing:
                    return []
            if not said:
                log.info(
                    "waiting for the shards on other nodes before the trainers start: %s",
                    ", ".join(f"{pid}/{rank}" for pid, rank in missing),
                )
                said = True
            await asyncio.sleep(POLL_S)
    return missing
