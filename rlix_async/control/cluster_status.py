"""What ``rlix-async status`` shows of a running coordinator: every pipeline's
holdings, demand and pace, the devices' owners and the fences, from the registry."""

from __future__ import annotations

import time

from rlix_async.control.registry import Registry
from rlix_async.protocols import messages as m
from rlix_async.protocols.topology import priority_name


def cluster_status(
    registry: Registry, shard_memory: dict[tuple[str, int], int], plans: tuple[int, int, int]
) -> m.StatusReply:
    """The reply to a StatusRequest: ``shard_memory`` is each shard's bytes in use,
    ``plans`` the plans applied, rejected by the validator and gone stale."""
    now = time.monotonic()
    memory: dict[str, dict[int, int]] = {}
    for (pid, rank), used in shard_memory.items():
        memory.setdefault(pid, {})[rank] = used
    pipes = [
        m.PipelineStatus(
            id=p.id,
            admitted=p.admitted,
            connected=p.connected,
            held={c: priority_name(pr) for c, pr in p.held.items()},
            active_ranks=sorted(p.active),
            remaining=p.remaining(),
            requests={c: priority_name(r.priority) for c, r in p.requests.items()},
            shard_memory=memory.get(p.id, {}),
            group=p.group,
            members=list(p.members),
            slowdown=registry.pace_of(p, now)[0],  # a member's own, a base group's worst
        )
        for p in registry.pipelines.values()
    ]
    applied, rejected, stale = plans
    return m.StatusReply(
        devices=registry.shape.num_devices,
        owners=registry.owners(),
        pipelines=pipes,
        plans=applied,
        rejected_plans=rejected,
        stale_plans=stale,
        fenced=[
            m.FenceStatus(
                pipeline=f.pipeline,
                rank=f.rank,
                devices=list(f.devices),
                holder=f.holder,
                reason=f.reason,
                age_s=round(now - f.since, 1),
            )
            for f in registry.fences.values()
        ],
    )
