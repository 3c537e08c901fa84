"""Data parallel over torch DDP: every rank holds the whole model and its share of the
batch, gradients averaged by DDP's reducer. The torch backend's :class:`ModelParallel`
(train/policy_update.py), and the megatron backend's at pipeline parallel 1, where
a replica is one stage."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist

from rlix_async.train import lora as lora_utils
from rlix_async.train.packing import Piece
from rlix_async.train.policy_update import sampling_token_logp


def _nothing(piece: Piece) -> None:
    return None


BeforePiece = Callable[[Piece], None]
# Logits [B, positions, V] of the last ``keep`` positions of ``ids`` under ``model``.
ForwardLogits = Callable[[torch.nn.Module, torch.Tensor, int], torch.Tensor]


def hf_logits(model: torch.nn.Module, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """A HF causal LM's logits of the last ``keep`` positions: the output layer and every
    softmax after it cost in proportion to the positions, and a step needs only those
    that predict response tokens (TRL's ``logits_to_keep``)."""
    return model(input_ids=ids, logits_to_keep=keep).logits


class DataParallel:
    """``dp_rank`` of ``dp_world`` replicas; ``group``: the replicas' process group
    (None: the default group). ``logits``: how the model gives its logits."""

    def __init__(
        self,
        device: torch.device,
        dp_rank: int,
        dp_world: int,
        *,
        temperature: float,
        top_p: float,
        max_grad_norm: float,
        logits: ForwardLogits = hf_logits,
        group: Callable[[], dist.ProcessGroup | None] = lambda: None,
    ) -> None:
        self.device = device
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.temperature, self.top_p = temperature, top_p
        self.max_grad_norm = max_grad_norm
        self.logits = logits
        self._group = group
        self.ddp: torch.nn.Module | None = None  # while a step's group is up

    def wrap(self, model: torch.nn.Module) -> None:
        """DDP around ``model`` for this step's group."""
        frozen = lora_utils.frozen_names(model)
        if frozen:
            # DDP broadcasts rank 0's parameters at every wrap, i.e. every step: the
            # frozen base would cross the link each time though every rank loaded the
            # same one (one directory, one seed) and none ever changes it
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, frozen
            )
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self._group(),
        )

    def unwrap(self) -> None:
        if self.ddp is not None:
            self.ddp = None
            # DDP sits in a reference cycle: without a collection its reducer keeps
            # gradient buckets the size of the model on the device after offload
            gc.collect()

    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group()

    def training_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.ddp or model

    def grads_averaged(self) -> bool:
        return self.ddp is not None

    def forward(
        self, model: torch.nn.Module, pieces: list[Piece], before: BeforePiece = _nothing
    ) -> None:
        """``before(piece)`` runs before each piece's forward (a backend's per-piece
        state: the routes a mixture-of-experts model replays)."""
        for p in pieces:
            before(p)
            p.take(self.logits(model, p.ids, p.width + 1))

    def forward_backward(
        self, model: torch.nn.Module, pieces: list[Piece], before: BeforePiece = _nothing
    ) -> None:
        """Gradients add up over the pieces; under DDP they are reduced once, after the
        last."""
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        for j, p in enumerate(pieces):
            before(p)
            last = j == len(pieces) - 1
            with contextlib.nullcontext() if last or not ddp else model.no_sync():  # type: ignore[operator]
                p.take(self.logits(model, p.ids, p.width + 1)).backward()

    def token_logp(
        self, logits: torch.Tensor, ids: torch.Tensor, width: int, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sampling_token_logp(
            logits,
            ids,
            width,
            temperature=self.temperature,
            top_p=self.top_p,
            with_entropy=with_entropy,
        )

    def clip_grads(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """torch's rule: scaled by max / (norm + 1e-6) when above."""
        return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    def after_optim_step(self) -> None:
        pass
