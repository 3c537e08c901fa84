"""Replay buffer of trajectory groups tagged with the weight versions that produced them.

A group is every sampled response to one prompt (GRPO needs them together).
Its age is ``trainer_version - oldest token version``; a group older than the
:class:`StalenessBound` allows is dropped and counted when a batch is taken,
never trained on.

Groups are protocols/batch.py's (what every trainer backend takes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlix_async.protocols.batch import Group


@dataclass(frozen=True)
class StalenessBound:
    """How old a token may be when it is trained on, and everything that follows from
    it; the one owner of the rule. Built from the pipeline's config
    (``max_trajectory_age_steps``; 0: on-policy), never from a checkpoint: a resume with
    a changed config follows the config everywhere at once."""

    max_steps: int = 1  # a trainer at version v trains on tokens of versions >= v - max_steps

    def too_old(self, oldest_version: int, version: int) -> bool:
        """Tokens from ``oldest_version`` are past the bound for a trainer at ``version``
        (and for every later one: a group that is too old never becomes usable)."""
        return version - oldest_version > self.max_steps

    def oldest_usable(self, batch_version: int) -> int:
        """The oldest weight version a request may run on if its group lands in the
        batch a trainer at ``batch_version`` takes (a request's ``min_version``)."""
        return max(batch_version - self.max_steps, 0)

    def batches_open(self, training: bool) -> int:
        """How many batches weights of the current version may still fill: this step's
        and the next ``max_steps``; while this step's batch trains it is already taken."""
        return self.max_steps + 1 - int(training)


@dataclass
class ReplayBuffer:
    bound: StalenessBound = field(default_factory=StalenessBound)
    groups: deque[Group] = field(default_factory=deque)
    added: int = 0  # trajectories (episodes: Group.size), not groups
    trained: int = 0
    dropped_stale: int = 0
    # told of every group dropped as stale, with the trainer version that dropped it
    # (the pipeline's ledger); not part of the state
    on_drop: Callable[[list[Group], int], None] | None = field(
        default=None, repr=False, compare=False
    )

    def add(self, group: Group) -> None:
        self.groups.append(group)
        self.added += group.size

    def add_stale(self, trajectories: int) -> None:
        """Count trajectories known to be too old before they were added (a group
        stopped early because a finished sibling was): added and dropped at once."""
        self.added += trajectories
        self.dropped_stale += trajectories

    def drop_stale(self, version: int) -> int:
        """Drop groups too old for a trainer at ``version``; returns trajectories dropped."""
        gone = [g for g in self.groups if self.bound.too_old(g.oldest_version, version)]
        if not gone:
            return 0
        self.groups = deque(
            g for g in self.groups if not self.bound.too_old(g.oldest_version, version)
        )
        dropped = sum(g.size for g in gone)
        self.dropped_stale += dropped
        if self.on_drop is not None:
            self.on_drop(gone, version)
        return dropped

    def fresh(self, version: int) -> int:
        """Trajectories a trainer at ``version`` may still use."""
        return sum(g.size for g in self.groups if not self.bound.too_old(g.oldest_version, version))

    def room(self, version: int, batch: int, training: bool) -> int:
        """Trajectories a collector may still start at ``version`` without any going stale.

        What weights ``version`` generate can fill (``bound.batches_open``: generating two
        batches ahead during training dropped ~20% of the demo's trajectories as stale).
        """
        return self.bound.batches_open(training) * batch - self.fresh(version)

    def ready(self, version: int, groups: int) -> bool:
        return sum(not self.bound.too_old(g.oldest_version, version) for g in self.groups) >= groups

    def take(self, version: int, groups: int) -> list[Group]:
        """``groups`` fresh-enough groups, oldest weights first (stale ones are dropped
        first): a group near the staleness bound is trained on now rather than
        dropped next step, whatever order the groups finished in."""
        self.drop_stale(version)
        batch = sorted(self.groups, key=lambda g: g.oldest_version)[:groups]  # stable sort
        taken = {id(g) for g in batch}
        self.groups = deque(g for g in self.groups if id(g) not in taken)
        self.trained += sum(g.size for g in batch)
        return batch

    def __len__(self) -> int:
        return sum(g.size for g in self.groups)

    def state_dict(self) -> dict[str, Any]:
        """Contents and counters; never the bound (it comes from the config)."""
        return {
            "groups": [g.to_dict() for g in self.groups],
            "added": self.added,
            "trained": self.trained,
            "dropped_stale": self.dropped_stale,
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, Any], bound: StalenessBound) -> ReplayBuffer:
        """A checkpoint's contents and counters under ``bound`` (the config's). What
        older checkpoints recorded as their bound (``max_trajectory_age_steps``, earlier
        ``max_age_steps``) is ignored."""
        # checked against the schema: a checkpoint is a file, not trusted to be well formed
        groups = msgspec.convert(d["groups"], list[Group])
        buf = cls(bound, deque(groups))
        buf.added, buf.trained, buf.dropped_stale = d["added"], d["trained"], d["dropped_stale"]
        return buf
