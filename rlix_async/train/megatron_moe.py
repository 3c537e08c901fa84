"""Mixture-of-experts models in the Megatron backend: an HF Qwen3-MoE directory's shape,
its TransformerConfig fields, and the names of its expert weights on each side.

Qwen3-MoE is Qwen3 attention (RMSNorm on each head's queries and keys: Megatron's
``qk_layernorm``) with a top-k softmax router over per-expert SwiGLU MLPs in the
layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick. Megatron builds it with
its own MoE layer (``SequentialMLP`` experts: grouped GEMMs need TransformerEngine),
the router in float32 and the load-balancing loss off (RL updates a trained model;
its routing is not to be rebalanced by the policy loss).

The router's probabilities: HF takes a softmax over every expert, then the top k, and
renormalizes them when ``norm_topk_prob``; Megatron's default (``pre_softmax`` off)
takes the top k logits and a softmax over those k, which is the same distribution.
Without ``norm_topk_prob`` HF keeps the unrenormalized probabilities: Megatron's
``pre_softmax``.

Names: transformers 5 holds a layer's experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2F, H], ``mlp.experts.down_proj`` [E, H, F]) and
writes them per expert (``mlp.experts.J.{gate,up,down}_proj.weight``), which is what
vLLM's loader and ``from_pretrained`` take; Megatron's ``SequentialMLP`` holds expert
J as ``mlp.experts.local_experts.J.linear_fc1.weight`` ([gate; up]) and
``linear_fc2.weight``. The cache and ``export`` carry the per-expert HF names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlix_async.train.tensor_parallel import LayoutError

MODEL_TYPES = ("qwen3_moe",)
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def moe_shape(c: Any) -> dict[str, Any]:
    """The MoE part of a Qwen3-MoE config's GPTModel shape: which layers are MoE (1)
    and which dense (0), as HF's ``Qwen3MoeDecoderLayer`` picks them, the experts, the
    top k and the router's softmax placement."""
    layers = c.num_hidden_layers
    step = max(int(getattr(c, "decoder_sparse_step", 1) or 1), 1)
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    return {
        "experts": int(c.num_experts),
        "topk": int(c.num_experts_per_tok),
        "ffn": int(c.moe_intermediate_size),
        "layers": [0 if (i in dense or (i + 1) % step) else 1 for i in range(layers)],
        "pre_softmax": not bool(getattr(c, "norm_topk_prob", True)),
    }


def check_moe_layout(moe: dict[str, Any] | None, tp: int, pp: int, ep: int = 1) -> None:
    """An MoE model trains at tensor parallel 1 here (at any pp and ep), or LayoutError:
    Megatron's MoE layer refuses to train at tp > 1 without sequence parallel (not
    built). Expert parallel needs experts, as many on every rank."""
    if moe is None:
        if ep > 1:
            raise LayoutError(f"ep {ep}: expert parallel needs a mixture-of-experts model")
        return
    if tp > 1:
        raise LayoutError(
            f"a mixture-of-experts model trains at tp 1 with the megatron backend (asked tp "
            f"{tp}): MoE at tp > 1 needs sequence parallel, not built yet; scale it with "
            "ep, pp and dp"
        )
    if moe["experts"] % ep:
        raise LayoutError(f"ep {ep}: the model's {moe['experts']} experts do not split over it")


def moe_config(moe: dict[str, Any], ep: int, pp: int) -> dict[str, Any]:
    """TransformerConfig's fields for ``moe`` (a shape's ``moe``) at expert parallel
    ``ep`` and pipeline parallel ``pp``. The all-gather dispatcher needs every rank of
    the expert group to send as many tokens (pieces here differ in rows and width) and
    refuses the variable lengths stages exchange: the all-to-all one takes both."""
    return {
        "num_moe_experts": moe["experts"],
        "moe_ffn_hidden_size": moe["ffn"],
        "moe_router_topk": moe["topk"],
        "moe_router_pre_softmax": moe["pre_softmax"],
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall" if ep > 1 or pp > 1 else "allgather",
        "expert_model_parallel_size": ep,
        "moe_grouped_gemm": False,  # SequentialMLP: grouped GEMMs need TransformerEngine
        "moe_permute_fusion": False,
        # a list, never Megatron's integer form (``i % n == 0``, not HF's rule)
        "moe_layer_freq": list(moe["layers"]),
    }


def bind_missing_te_gemm() -> None:
    """megatron-core 0.16.1's ``moe_utils`` binds ``te_general_gemm`` only when
    TransformerEngine imports, then tests it against None in the router's matmul:
    without TransformerEngine (CPU, or a GPU machine without it) every MoE forward
    raises NameError. Bound to None, the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def expert_to_hf(rest: str, v: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A Megatron expert weight (``rest``: its name within a layer) as HF's per-expert
    tensors; None when ``rest`` is no expert weight. At expert parallel 1 the local
    index is the expert's own."""
    m = _EXPERT.fullmatch(rest)
    if m is None:
        return None
    j, fc = m.groups()
    pre = f"mlp.experts.{j}."
    if fc == "2":
        return {pre + "down_proj.weight": v}
    gate, up = v.chunk(2, 0)
    return {pre + "gate_proj.weight": gate, pre + "up_proj.weight": up}


def fuse_experts(state: dict[str, torch.Tensor], fused: set[str]) -> dict[str, torch.Tensor]:
    """``state`` with each layer's per-expert HF tensors stacked into the fused ones
    ``fused`` names (a transformers model's in-memory keys): ``gate_up_proj[e]`` is
    [gate_e; up_e], ``down_proj[e]`` is down_e. Exact: a copy, no arithmetic."""
    out = dict(state)
    for key in sorted(k for k in fused if k.endswith("mlp.experts.gate_up_proj") and k not in out):
        pre = key.removesuffix("gate_up_proj")
        n = 0
        while f"{pre}{n}.gate_proj.weight" in out:
            n += 1
        if n == 0:
            continue  # nothing to fuse: the load will name what is missing
        parts = [
            [out.pop(f"{pre}{e}.{w}_proj.weight") for w in ("gate", "up", "down")] for e in range(n)
        ]
        out[key] = torch.stack([torch.cat([g, u], 0) for g, u, _ in parts])
        out[pre + "down_proj"] = torch.stack([d for _, _, d in parts])
    return out


def experts_to_megatron(parts: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """A layer's HF expert tensors (popped from ``parts``: per expert as saved, or fused
    as transformers holds them in memory) in Megatron's names under ``layer``."""
    out: dict[str, torch.Tensor] = {}
    fused = [parts.pop(f"mlp.experts.{n}", None) for n in ("gate_up_proj", "down_proj")]
    if any(t is not None for t in fused):  # [E, 2F, H] (gate first), [E, H, F]
        gate_up, down = fused
        if gate_up is None or down is None:
            raise KeyError(
                f"{layer}: fused experts without {'down' if down is None else 'gate_up'}_proj"
            )
        for e in range(gate_up.shape[0]):
            out[f"{layer}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
            out[f"{layer}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    per: dict[str, dict[str, torch.Tensor]] = {}
    for name in list(parts):
        if (m := _HF_EXPERT.fullmatch(name)) is not None:
            per.setdefault(m.group(1), {})[m.group(2)] = parts.pop(name)
    for j, w in per.items():
        if set(w) != {"gate", "up", "down"}:
            raise KeyError(f"expert {j} of {layer} lacks {sorted({'gate', 'up', 'down'} - set(w))}")
        fc1 = torch.cat([w["gate"], w["up"]], 0)  # [gate; up]
        out[f"{layer}mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1
        out[f"{layer}mlp.experts.local_experts.{j}.linear_fc2.weight"] = w["down"]
    return out


def expert_global_name(name: str, ep_rank: int, per: int) -> str:
    """The full model's name of this rank's expert weight ``name`` (Megatron's local
    index J is expert ``ep_rank x per + J``, ``per`` experts a rank); any other name
    as it is."""
    m = _LOCAL_EXPERT.search(name)
    if m is None or ep_rank == 0:
        return name
    return _renumbered(name, m, int(m.group(1)) + ep_rank * per)


def _renumbered(name: str, m: re.Match[str], index: int) -> str:
    """``name`` with the expert index ``m`` found in it replaced by ``index``."""
    return f"{name[: m.start(1)]}{index}{name[m.end(1) :]}"


def to_expert_rank(full: Mapping[str, Any], ep_rank: int, ep: int, experts: int) -> dict[str, Any]:
    """Expert-parallel rank ``ep_rank``'s part of ``full`` (Megatron's names, experts
    by their global index): every non-expert entry, and its own experts renamed to
    their local index."""
    if ep == 1:
        return dict(full)
    per = experts // ep
    out: dict[str, Any] = {}
    for name, v in full.items():
        m = _LOCAL_EXPERT.search(name)
        if m is None:
            out[name] = v
        elif ep_rank * per <= (g := int(m.group(1))) < (ep_rank + 1) * per:
            out[_renumbered(name, m, g - ep_rank * per)] = v
    return out


def expert_reads(ep_rank: int, ep: int, experts: int) -> Callable[[str], bool]:
    """Which HF tensors expert-parallel rank ``ep_rank`` reads: all but the other
    ranks' per-expert ones (fused ones, as transformers holds them in memory, are read
    whole and cut after conversion)."""
    per = experts // ep

    def wanted(name: str) -> bool:
        m = _HF_EXPERT.search(name)
        return m is None or ep_rank * per <= int(m.group(1)) < (ep_rank + 1) * per

    return wanted


def is_expert(name: str) -> bool:
    """Whether Megatron's ``name`` is an expert weight (split over expert parallel)."""
    return _LOCAL_EXPERT.search(name) is not None


def sum_over_ranks(
    counts: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A step's float64 ``counts`` (None: zeros of ``shape``) summed over every rank of
    the default group (on the device under NCCL, in host memory under gloo), on the
    host."""
    import torch.distributed as dist

    total = counts if counts is not None else torch.zeros(shape, dtype=torch.float64)
    if dist.is_initialized():
        total = total.to(device if dist.get_backend() == "nccl" else "cpu", torch.float64)
        dist.all_reduce(total)
    return total.cpu()


class ExpertLoad:
    """How many token positions each MoE layer's router sent to each expert in a step's
    update passes (every row's positions once: pi_old's pass runs in eval mode and a
    recomputed forward inside the backward is skipped), counted by forward hooks on
    ``model``'s routers. ``global_layer(name)``: the full model's layer index of a
    router module's name (pipeline stages hold other layers)."""

    def __init__(
        self, model: torch.nn.Module, global_layer: Callable[[str], int], layers: int, experts: int
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.shape = (layers, experts)
        # on the routers' device until ``stats`` (no host sync per layer and piece)
        self.counts: torch.Tensor | None = None
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook(global_layer(name)))

    def _hook(self, layer: int) -> Callable[..., None]:
        def count(module: torch.nn.Module, args: Any, out: Any) -> None:
            # the update passes only (train mode), not their recomputation in backward
            if module.training and torch._C._current_autograd_node() is None:
                routing_map = out[1]  # [tokens, experts], True where routed
                if self.counts is None:
                    self.counts = torch.zeros(
                        self.shape, dtype=torch.float64, device=routing_map.device
                    )
                self.counts[layer] += routing_map.sum(0)

        return count

    def stats(self, device: torch.device) -> dict[str, float]:
        """The step's figures, summed over every rank (each holds its own tokens of its
        own layers; MoE trains at tp 1, so no rank repeats another's), then reset: per
        MoE layer its busiest expert's tokens over the mean (1: balanced; at most E/k)
        and its idlest's, the busiest and idlest over all layers."""
        # every rank calls: one with no MoE layer sends zeros
        counts = sum_over_ranks(self.counts, self.shape, device)
        self.counts = None
        out: dict[str, float] = {}
        high, low = [], []
        for layer in range(counts.shape[0]):
            row = counts[layer]
            if row.sum() > 0:
                high.append(float(row.max() / row.mean()))
                low.append(float(row.min() / row.mean()))
                out[f"moe/load_max_over_mean/layer_{layer}"] = high[-1]
        if high:
            out["moe/load_max_over_mean"] = max(high)
            out["moe/load_min_over_mean"] = min(low)
        return out
