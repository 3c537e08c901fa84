"""What a pipeline trains on: a trajectory group, every sampled response to one prompt
(GRPO needs them together), with the engine's log-probs and the weight version of
every token. The collector makes groups, the replay buffer holds them, every trainer
backend's ``train_step`` takes a batch of them (protocols/trainer.py).

A group is a msgspec struct: it crosses from rank 0 to the other trainer ranks as
msgpack (``encode_batch``/``decode_batch``, checked against this schema on decode)
and sits in checkpoints as plain lists, so neither path ever unpickles.
"""

from __future__ import annotations

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
    # mixture-of-experts routing replay (train.routing_replay): per response, the experts
    # the engine's routers chose for every token it computed as an input, i.e. positions
    # 0 .. len(prompt) + len(response) - 2 of prompt + response: uint8 [positions,
    # MoE layers (in layer order), top k (in the router's rank order)], C order; b"" for
    # a response the engine recorded none for; empty: none at all
    routes: list[bytes] = []

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
        if self.routes and len(self.routes) != n:
            raise ValueError("group: one routes entry per response (b'' for none)")
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
