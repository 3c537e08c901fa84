"""``launch --node K``: a trainer whose pipeline's shards run on other nodes starts once
they have joined the coordinator, as the one-node launcher starts trainers once its own
shards are ready. Without the wait a short run can finish before a slow engine on
another node joined (its shards' starts are minutes on a loaded host), and a longer one
begins on part of its rollout capacity.

Which shards: :func:`remote_shards` reads the whole plan (every node's processes);
whether they joined: the coordinator's status (``StatusReply.workers``, the shard
workers connected now), asked with this node's driver key (:class:`RemoteShardsWait`).
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


class RemoteShardsWait:
    """Whether the shards in ``wanted`` have joined the coordinator at ``endpoint``,
    asked at most every ``POLL_S`` from the launcher's supervision pass (which goes on
    meanwhile: a local process that dies, or a coordinator to restart, is handled).
    Asked under ``driver``'s identity and key (``driver-ID``, else the shared
    ``client``): a node holds its own trainers' driver keys, which may read the status
    as a router of their pipeline, and nothing more is needed."""

    def __init__(
        self,
        wanted: dict[str, set[int]],
        endpoint: str,
        keys_dir: str | None,
        driver: str,
        timeout_s: float,
    ) -> None:
        self.missing = sorted((pid, rank) for pid, ranks in wanted.items() for rank in ranks)
        self.endpoint = endpoint
        self.keys = (
            ClientKeys.load_first(Path(keys_dir), f"driver-{driver}", "client")[1]
            if keys_dir
            else None
        )
        self.identity = f"{driver}/router/launch-{uuid.uuid4().hex[:8]}"
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self._next = 0.0
        self._said = False

    def ready(self) -> bool:
        """True once every wanted shard joined; RuntimeError (one line naming the
        missing ones) past the deadline."""
        if not self.missing:
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + POLL_S
        try:
            workers = asyncio.run(self._workers())
        except Exception as exc:  # the coordinator starting or restarting: asked again
            log.debug("status: %s", exc)
            workers = None
        if workers is not None:
            self.missing = [(p, r) for p, r in self.missing if r not in workers.get(p, [])]
        if not self.missing:
            return True
        if now > self.deadline:
            names = ", ".join(f"{pid}/{rank}" for pid, rank in self.missing)
            raise RuntimeError(
                f"shards on other nodes not joined after {self.timeout_s:.0f}s: {names} "
                "(is their node's `launch --node` running?)"
            )
        if not self._said:  # a warning: an operator sees why nothing trains yet
            self._said = True
            log.warning(
                "trainers start once the shards on other nodes joined: waiting for %s",
                ", ".join(f"{pid}/{rank}" for pid, rank in self.missing),
            )
        return False

    async def _workers(self) -> dict[str, list[int]]:
        # short waits: this runs inside the launcher's supervision pass
        client = RpcClient(self.endpoint, self.identity, keys=self.keys)
        try:
            await client.connect(timeout=2.0)
            reply = await client.call(m.StatusRequest(), timeout=5.0)
        finally:
            await client.close()
        if not isinstance(reply, m.StatusReply):
            raise RuntimeError(f"status answered {type(reply).__name__}")
        return reply.workers
