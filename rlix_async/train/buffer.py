"""Replay buffer of trajectory groups tagged with the weight versions that produced them.

A group is every sampled response to one prompt (GRPO needs them together).
Its age is ``trainer_version - oldest token version``; a group older than the
:class:`StalenessBound` allows is dropped and counted when a batch is taken,
never trained on.

A group is a msgspec struct: it crosses from rank 0 to the other trainer ranks
as msgpack (``encode_batch``/``decode_batch``, checked against this schema on
decode) and sits in checkpoints as plain lists, so neither path ever unpickles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec


class Group(msgspec.Struct):
    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]  # behaviour log-probs from the engine, per token
    versions: list[list[int]]  # weight version (trainer step) of every token
    rewards: list[float]
    resumes: int = 0  # times any of its requests was cut by a shrink and resumed
    # the trajectory ledger's name for it (rollout/ledger.py), kept through checkpoints so
    # a restart can tell which finished groups came back; "" outside a pipeline
    id: str = ""
    # text recipes: what the model saw and said (samples.jsonl), and the reward's named
    # extras per response (logged as per-step means); empty for token-id tasks
    prompt_text: str = ""
    response_texts: list[str] = []
    reward_extras: dict[str, list[float]] = {}
    # multi-turn episodes (rollout/episodes.py): per response, 1 where the model wrote the
    # token and 0 where the environment did (never trained on); empty: every token is the
    # model's. ``episodes``: per-response figures (turns, env seconds, tokens by source)
    masks: list[list[int]] = []
    episodes: dict[str, list[float]] = {}
    # agent_api episodes split into several trajectories (rollout/api_agents.py): per
    # response, the episode (0, 1, ...) it belongs to, so advantages are the episodes'
    # (a split episode weighs no more in the group's mean); empty: one each
    members: list[int] = []

    def __post_init__(self) -> None:
        n = len(self.responses)
        if not n or not (len(self.logprobs) == len(self.versions) == len(self.rewards) == n):
            raise ValueError("group: responses, logprobs, versions and rewards must align")
        if self.response_texts and len(self.response_texts) != n:
            raise ValueError("group: one response text per response")
        if any(len(v) != n for v in (*self.reward_extras.values(), *self.episodes.values())):
            raise ValueError(
                "group: one value of each reward extra and episode figure per response"
            )
        if self.members and (
            len(self.members) != n
            or sorted(set(self.members)) != list(range(max(self.members) + 1))
        ):
            raise ValueError("group: one member index per response, numbering episodes from 0")
        if self.members and len(set(zip(self.members, self.rewards, strict=True))) != self.size:
            raise ValueError("group: an episode's trajectories share its reward")
        if self.masks and (
            len(self.masks) != n
            or any(len(m) != len(r) for m, r in zip(self.masks, self.responses, strict=True))
        ):
            raise ValueError("group: one mask per response, a value per token")
        for r, lp, v in zip(self.responses, self.logprobs, self.versions, strict=True):
            if not (len(r) == len(lp) == len(v)):
                raise ValueError("group: every token needs a log-prob and a version")

    @property
    def size(self) -> int:
        """Its trajectories as the collector and the batch count them: one per episode
        (an episode split into several trajectories is one, Group.members)."""
        return len(set(self.members)) if self.members else len(self.responses)

    @property
    def oldest_version(self) -> int:
        return min((min(v) for v in self.versions if v), default=0)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


_BATCH = msgspec.msgpack.Decoder(list[Group])


def encode_batch(batch: list[Group]) -> bytes:
    return msgspec.msgpack.encode(batch)


def decode_batch(data: bytes) -> list[Group]:
    """A batch from ``encode_batch``; anything else (other bytes, a pickle, a group that
    breaks its own rules) is a ValueError naming what is wrong, never code that runs."""
    try:
        return _BATCH.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"not a batch of trajectory groups ({len(data)} bytes): {exc}") from None


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
