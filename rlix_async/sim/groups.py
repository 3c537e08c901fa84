"""Who a simulated shard serves: one full-weight pipeline, or a base group.

The registry owns a pipeline's rollout shards under the pipeline's id, or, for
LoRA pipelines on one frozen base (``ScenarioPipeline.base``), under the base
group's id: plans shrink and expand the group's ranks, and one vLLM engine per
shard serves every member per request (a ``LoRARequest`` each). A
:class:`Server` is that owner's shard state in the simulator; a pipeline
without a base is the only member of its own, so the engine has one path for
both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from rlix_async.protocols.topology import ClusterSpec

W = TypeVar("W")


@dataclass
class Server:
    id: str  # the registry id that owns the shards: the pipeline's, or its base group's
    spec: ClusterSpec  # actor_infer, the same for every member
    slots_per_shard: int  # the same for every member (Scenario checks both)
    # LoRA members on a frozen base: a step loads only an adapter, and the shard
    # serves on meanwhile. Full-weight (False): the shard pauses for the whole sync.
    lora: bool
    members: list[str] = field(default_factory=list)  # in scenario order
    ready: set[int] = field(default_factory=set)  # serving ranks
    slots: dict[int, int] = field(default_factory=dict)  # rank -> trajectories running
    epoch: dict[int, int] = field(default_factory=dict)  # rank -> wake generation
    # (member, rank) -> when the member's newest adapter is loaded on that shard: its
    # trajectories started there before then wait for it (no one else's do).
    adapter_at: dict[tuple[str, int], float] = field(default_factory=dict)
    turn: int = 0  # round robin: the member offered the next free slot

    def next_members(self) -> list[str]:
        """Every member once, starting with the one whose turn it is."""
        k = self.turn % len(self.members)
        return self.members[k:] + self.members[:k]

    def take_turn(self, work_of: Callable[[str], W | None]) -> tuple[str, W] | None:
        """The next member in turn with a trajectory to start (``work_of``: its work, or
        None) and that work; the turn moves past it. None: no member has one."""
        for pid in self.next_members():
            work = work_of(pid)
            if work is not None:
                self.turn = self.members.index(pid) + 1
                return pid, work
        return None

    def loaded_at(self, member: str, rank: int, now: float) -> float:
        """When a trajectory of ``member`` started now on ``rank`` can run."""
        if not self.adapter_at:  # (full-weight, or no step finished yet)
            return now
        return max(now, self.adapter_at.get((member, rank), now))

    def new_adapter(self, member: str, ranks: set[int], until: float) -> None:
        """``member``'s new version is being loaded on ``ranks`` until ``until``."""
        for rank in ranks:
            self.adapter_at[(member, rank)] = until


def servers_of(pipelines: list[tuple[str, str | None, ClusterSpec, int]]) -> dict[str, Server]:
    """The shard owners of (id, base, actor_infer, slots_per_shard) pipelines, keyed by
    owner id: each base group once, each pipeline without a base under its own id."""
    out: dict[str, Server] = {}
    for pid, base, spec, slots in pipelines:
        sid = base if base is not None else pid
        s = out.setdefault(sid, Server(sid, spec, slots, lora=base is not None))
        s.members.append(pid)
    return out
