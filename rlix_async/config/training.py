"""The trainer's config: backend, precision, optimizer, batch splitting and the policy loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rlix_async.config.model import ModelConfig
from rlix_async.config.schema_base import Config, doc, invalid
from rlix_async.protocols.topology import ClusterSpec


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
    mask_ratio: Annotated[
        Annotated[float, msgspec.Meta(gt=1)] | None,
        doc(
            "Token masking of training-inference mismatch (IcePop): a response token "
            "whose pi_old / pi_behaviour leaves [1/mask_ratio, mask_ratio] is left out "
            "of the policy-gradient term (weight 0; the KL term, if any, keeps it; "
            "counted in the step row's ratio_masked_frac), where truncation alone "
            "(is_cap) would still train on it. Unset: off."
        ),
    ] = None
    kl_coef: Annotated[
        float,
        doc(
            "Weight of the k3 KL penalty to the reference model: a frozen copy of the "
            "starting weights, kept beside the policy (its memory too). 0: no reference.",
            ge=0,
        ),
    ] = 0.0


class TrainSection(Config, frozen=True, tag_field="backend"):
    """What every trainer backend's section holds; ``backend`` picks the section (a
    tagged union: a key of another backend is refused by the schema). Unset, the
    backend is torch. A backend is built from its section by train/backends.py."""

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
    loss: Annotated[LossConfig, doc("The policy loss.")] = LossConfig()
    routing_replay: Annotated[
        Literal["auto", "none", "rollout"],
        doc(
            "Mixture-of-experts models: rollout makes the trainer's routers pick the "
            "experts the engine's routers picked for each token it generated from (the "
            "shards record them; megatron backend), so rounding differences between the "
            "two cannot send a token through other experts and blow up its importance "
            "ratio; rows carry routing_agreement, how often the trainer's own choice "
            "agreed. none: the trainer routes on its own. auto: rollout for an MoE model "
            "under the megatron backend, else none."
        ),
    ] = "auto"

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise invalid(
                "max_tokens_per_micro_batch",
                "cut micro-batches by rows (micro_batch_size) or by tokens, not both",
            )

    def check_layout(self, spec: ClusterSpec, model: ModelConfig) -> None:
        """The trainer's layout (``clusters.actor_train``) for this backend: data
        parallel only unless a backend says otherwise (raises ``field: why``)."""
        if self.routing_replay == "rollout":
            raise invalid(
                "train.routing_replay",
                f"rollout: the {self.backend} backend routes on its own (routing replay "
                "is the megatron backend's); use auto or none",
            )
        key = next((k for k in ("tp", "pp", "ep") if getattr(spec, k) != 1), None)
        if key is not None:
            raise invalid(
                f"clusters.actor_train.{key}",
                f"{getattr(spec, key)}: the {self.backend} backend is data parallel only "
                "(use tp: 1, pp: 1, ep: 1; tensor, pipeline and expert parallel are the "
                "megatron backend's)",
            )

    @property
    def backend(self) -> str:
        """The section's tag (torch, megatron, custom)."""
        return str(self.__struct_config__.tag)


class TorchTrainConfig(TrainSection, frozen=True, tag="torch"):
    """The HF model under torch DDP (train/trainer.py)."""

    recompute: Annotated[
        Literal["none", "full"],
        doc(
            "Activation recomputation: full keeps only each decoder layer's inputs and "
            "computes its activations again in the backward pass; none keeps everything."
        ),
    ] = "none"


class MegatronTrainConfig(TrainSection, frozen=True, tag="megatron"):
    """A megatron-core GPTModel at tensor x pipeline x expert x data parallel (train/megatron.py).

    Built from model.path (Llama-family and Qwen3-MoE directories; others are refused
    at launch) or the tiny model's shape; expert parallel needs a mixture-of-experts
    model (Qwen3-MoE)."""

    recompute: Annotated[
        Literal["none", "selective", "full"],
        doc(
            "Activation recomputation: keep less for the backward pass and compute it "
            "again there. full: each transformer layer's activations; selective: core "
            "attention only (the cheap part with the largest activations). none: keep "
            "everything."
        ),
    ] = "none"
    distributed_optimizer: Annotated[
        bool,
        doc(
            "Shard the optimizer state (float32 main weights and Adam moments, 12 bytes "
            "a parameter under bfloat16) over the data-parallel replicas by whole "
            "parameters (ZeRO stage 1): each keeps and steps its own share, then sends "
            "those weights to the others. Memory, not maths: the same updates."
        ),
    ] = False

    def check_layout(self, spec: ClusterSpec, model: ModelConfig) -> None:
        """Whole attention heads and query groups per tensor-parallel rank, whole layers
        per stage, whole experts per expert-parallel rank (read from the model
        directory's config.json, or the tiny model's shape, heads of 64 and no experts),
        devices a multiple of tp x pp x ep (where each rank sits:
        protocols/topology.trainer_place)."""
        tp, pp, ep = spec.tp, spec.pp, spec.ep
        if self.routing_replay == "rollout" and not moe_experts(model):
            raise invalid("train.routing_replay", "rollout: routing replay needs a "
                          "mixture-of-experts model (auto turns it on for one)")  # fmt: skip
        if tp == 1 and pp == 1 and ep == 1:
            return
        what = next(f"{k}={getattr(spec, k)}" for k in ("tp", "pp", "ep") if getattr(spec, k) != 1)
        heads, groups, ffn, layers, experts = _model_shape(model, what)
        at = "clusters.actor_train"
        if heads % tp or groups % tp:
            raise invalid(f"{at}.tp", f"{tp}: the model has {heads} attention heads in "
                          f"{groups} query groups; tensor parallel must divide both")  # fmt: skip
        if ffn % tp:
            raise invalid(f"{at}.tp", f"{tp}: the model's MLP width {ffn} does not split over it")
        if layers % pp:
            raise invalid(f"{at}.pp", f"{pp}: the model's {layers} layers do not split into "
                          "as many per stage")  # fmt: skip
        if ep > 1 and not experts:
            source = "config.json has no num_experts" if model.path else "the tiny model is dense"
            raise invalid(f"{at}.ep", f"{ep}: ep needs a mixture-of-experts model ({source})")
        if experts and experts % ep:
            raise invalid(f"{at}.ep", f"{ep}: the model's {experts} experts do not split over it")
        span = tp * pp * ep
        if len(spec.devices) % span:
            # with ep, a replica's experts are spread over ep replicas: the unit is those
            whole, sizes = ("replica", "tp x pp") if ep == 1 else ("layout", "tp x pp x ep")
            raise invalid(f"{at}.devices", f"{len(spec.devices)} devices: a {whole} spans "
                          f"{sizes} = {span}, so they must be a multiple of it")  # fmt: skip
        if ep > 1 and self.distributed_optimizer:
            raise invalid(f"{at}.ep", f"{ep}: the distributed optimizer does not shard expert "
                          "state yet: set distributed_optimizer: false with ep > 1")  # fmt: skip


def _model_shape(model: ModelConfig, what: str) -> tuple[int, int, int, int, int | None]:
    """(attention heads, query groups, MLP width, layers, experts or None if dense) of
    the model a layout splits; ``what`` names the layout for a config.json we cannot read."""
    if model.path is None:  # the tiny model: a dense Llama with heads of 64
        heads = model.hidden // 64
        return heads, heads, 2 * model.hidden, model.layers, None
    try:
        c = json.loads((Path(model.path) / "config.json").read_text())
        heads = int(c["num_attention_heads"])
        groups = int(c.get("num_key_value_heads") or heads)
        experts = _experts_of(c)
        return heads, groups, int(c["intermediate_size"]), int(c["num_hidden_layers"]), experts
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise invalid(
            "model.path", f"no readable config.json to split over {what} ({exc})"
        ) from None


class CustomTrainConfig(TrainSection, frozen=True, kw_only=True, tag="custom"):
    """A trainer backend of your own (examples/trainers/sgd_trainer.py is one).

    It reads the common keys as the package's backends do, and whatever more it needs
    from custom_args; its layout (tp, pp, ep) is its own to check."""

    custom: Annotated[
        str,
        doc(
            "'package.module:NAME' or 'path/to/file.py:NAME': a TrainerBackend "
            "(rlix_async/train/backends.py) whose build() makes each rank's trainer."
        ),
    ]
    custom_args: Annotated[dict[str, Any], doc("Keyword arguments for the backend.")] = {}

    def check_layout(self, spec: ClusterSpec, model: ModelConfig) -> None:
        pass  # the backend's own (TrainerBackend.check, at launch)


# The trainer section: which fields exist depends on ``backend`` (torch when unset).
TrainConfig = TorchTrainConfig | MegatronTrainConfig | CustomTrainConfig


def moe_experts(model: ModelConfig) -> int | None:
    """The routed experts of ``model`` (None: a dense model, or no readable config)."""
    if model.path is None:
        return None
    try:
        return _experts_of(json.loads((Path(model.path) / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _experts_of(config: dict[str, Any]) -> int | None:
    """A config.json's routed experts: Qwen3-MoE checkpoints say num_experts,
    transformers 5 writes num_local_experts for them; a dense config has neither (or
    0/null)."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    return int(experts) if experts else None


def replays_routes(train: TrainSection, model: ModelConfig) -> bool:
    """Whether the trainer replays the engine's routing (``train.routing_replay``
    resolved): the shards record routes exactly when this holds."""
    if train.routing_replay == "auto":
        return train.backend == "megatron" and moe_experts(model) is not None
    return train.routing_replay == "rollout"
