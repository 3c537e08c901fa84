"""Which device a trainer rank binds: one per rank, in the order the process sees them."""

from __future__ import annotations


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
