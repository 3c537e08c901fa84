"""Which device a trainer rank binds: one per rank, in the order the process sees them."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def trainer_device(
    local_rank: int, local_world: int, cuda_count: int, visible_devices: str | None = None
) -> str:
    """The device of local rank ``local_rank`` of the ``local_world`` ranks on this node.

    One device per rank, in the order the process sees them: the launcher sets
    ``CUDA_VISIBLE_DEVICES`` to the pipeline's actor_train devices, so
    ``cuda:{local_rank}`` is this rank's own. Fewer devices than ranks is a launch
    error, never wrapped modulo: two ranks on one device make NCCL refuse the group
    ("Duplicate GPU detected") or, under gloo, share its memory unseen.
    """
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside the node's {local_world} ranks")
    if cuda_count == 0:
        return "cpu"
    if cuda_count < local_world:
        shown = "unset" if visible_devices is None else repr(visible_devices)
        raise ValueError(
            f"trainer local rank {local_rank} of {local_world} sees {cuda_count} CUDA "
            f"device(s) (CUDA_VISIBLE_DEVICES={shown}): the launcher binds one device per "
            f"rank, so this node's ranks need {local_world}"
        )
    return f"cuda:{local_rank}"


@dataclass(frozen=True)
class RankPlace:
    """Where a trainer rank runs: its global rank of ``world``, its place among the
    ranks on its node, and its device (one per rank, :func:`trainer_device`)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device

    @classmethod
    def of(cls, rank: int, world: int) -> RankPlace:
        """torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE, or without them the rank
        arguments (every rank on this node); the device bound as the current one
        before any NCCL group or CUDA allocation."""
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = torch.device(
            trainer_device(
                local_rank, local_world, cuda_count, os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(rank, world, local_rank, local_world, device)

    @property
    def backend(self) -> str:
        """The collective backend of this rank's groups: NCCL on CUDA, gloo on CPU."""
        return "nccl" if self.device.type == "cuda" else "gloo"
