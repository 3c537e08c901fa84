"""The trainer's config: backend, precision, optimizer, batch splitting and the policy loss."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rlix_async.config.schema_base import Config, doc, invalid


class LossConfig(Config, frozen=True):
    kind: Annotated[
        Literal["dapo", "cispo"],
        doc("dapo: clipped ratio, clip-higher; cispo: clipped IS weight on every token."),
    ] = "dapo"
    eps_low: Annotated[float, doc("Lower clip: ratio >= 1 - eps_low.", ge=0, lt=1)] = 0.2
    eps_high: Annotated[float, doc("Upper clip: ratio <= 1 + eps_high (clip-higher).", ge=0)] = 0.28
    is_cap: Annotated[
        float, doc("Truncation of the importance weight pi_old / pi_behaviour.", gt=0)
    ] = 2.0
    kl_coef: Annotated[
        float,
        doc(
            "Weight of the k3 KL penalty to the reference model: a frozen copy of the "
            "starting weights, kept beside the policy (its memory too). 0: no reference.",
            ge=0,
        ),
    ] = 0.0


class TrainConfig(Config, frozen=True):
    backend: Annotated[
        Literal["torch", "megatron"],
        doc(
            "torch: the HF model under DDP; megatron: a megatron-core GPTModel, built from "
            "model.path (Llama-family directories only; others are refused at launch) or "
            "the tiny model's shape."
        ),
    ] = "torch"
    dtype: Annotated[
        Literal["auto", "bfloat16", "bfloat16_pure", "float32"],
        doc(
            "Parameters and the weight cache. auto: bfloat16 on CUDA, float32 on CPU. "
            "bfloat16: bf16 parameters and compute, with float32 main parameters and "
            "float32 Adam state in the optimizer (mixed precision, as Megatron's "
            "bf16 optimizer: 16 bytes a parameter with its gradient). bfloat16_pure: bf16 "
            "parameters and Adam state only (8 bytes a parameter); an update below a "
            "weight's bf16 resolution is lost, which at RL's learning rates (1e-6 to "
            "1e-5) is most of them: the launch warns. Log-probs, importance ratios and "
            "losses are always float32."
        ),
    ] = "auto"
    lr: Annotated[float, doc("AdamW learning rate.", gt=0)] = 2e-3
    lr_schedule: Annotated[
        Literal["constant", "linear"],
        doc(
            "constant: lr at every update. linear: from lr down to 0 at the pipeline's "
            "last update (steps x minibatches updates), as TRL's and transformers' default "
            "(get_linear_schedule_with_warmup). Both after the warmup."
        ),
    ] = "constant"
    warmup_steps: Annotated[
        int,
        doc(
            "Training steps over which the learning rate rises linearly from 0 (each step's "
            "minibatches updates count as their fraction of it). 0: none.",
            ge=0,
        ),
    ] = 0
    weight_decay: Annotated[float, doc("AdamW weight decay.", ge=0)] = 0.0
    max_grad_norm: Annotated[float, doc("Gradient clipping norm.", gt=0)] = 1.0
    minibatches: Annotated[int, doc("Optimizer steps per training step.", ge=1)] = 2
    micro_batch_size: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "Sequences per forward/backward on a rank: a minibatch larger than this is "
            "run in pieces whose gradients add up to the same update (gradient "
            "accumulation; memory, not maths). Unset: the whole minibatch at once."
        ),
    ] = None
    max_tokens_per_micro_batch: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "Micro-batches cut by a token budget instead of a row count: a minibatch's rows, "
            "longest first, go into pieces of at most this many tokens, padding included "
            "(rows x the piece's longest row); a row longer than the budget is a piece of "
            "its own. Long agentic trajectories then fit where a fixed count would not. "
            "Exclusive with micro_batch_size."
        ),
    ] = None
    recompute: Annotated[
        Literal["none", "selective", "full"],
        doc(
            "Activation recomputation: keep less for the backward pass and compute it "
            "again there. full: each transformer layer's activations (both backends); "
            "selective: core attention only (megatron backend: the cheap part with the "
            "largest activations). none: keep everything."
        ),
    ] = "none"
    distributed_optimizer: Annotated[
        bool,
        doc(
            "megatron backend: shard the optimizer state (float32 main weights and Adam "
            "moments, 12 bytes a parameter under bfloat16) over the data-parallel "
            "replicas by whole parameters (ZeRO stage 1): each keeps and steps its own "
            "share, then sends those weights to the others. Memory, not maths: the "
            "same updates."
        ),
    ] = False
    loss: Annotated[LossConfig, doc("The policy loss.")] = LossConfig()

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise invalid(
                "max_tokens_per_micro_batch",
                "cut micro-batches by rows (micro_batch_size) or by tokens, not both",
            )
        if self.distributed_optimizer and self.backend != "megatron":
            raise invalid(
                "distributed_optimizer",
                "the megatron backend's (its checkpoints are written by every rank); the "
                "torch backend keeps the whole optimizer on every rank",
            )
        if self.recompute == "selective" and self.backend != "megatron":
            raise invalid(
                "recompute",
                "selective (core attention only) is the megatron backend's; the torch "
                "backend recomputes whole layers: use full",
            )
