"""How a Megatron ``GPTModel``'s weights split over tensor-parallel ranks, as pure
functions on state dicts (the trainer gathers and scatters with them; tests check them
without a process group).

The layout is megatron-core's local spec without sequence parallelism:

- column-parallel weights split their rows (dim 0): the fused ``linear_qkv`` (whole
  query groups per rank: a group's q heads, k and v stay together, so rank r's rows are
  the r-th contiguous block), the output layer and the word embedding (rows = the
  vocabulary, padded to a multiple of the tensor-parallel size);
- ``linear_fc1`` is column-parallel too, but fuses [gate; up]: rank r holds
  [gate_r; up_r], the r-th block of each half, because the SwiGLU halves its *local*
  output;
- row-parallel weights (``linear_proj``, ``linear_fc2``) split their columns (dim 1);
- norms are whole on every rank.

The "full" state is the one-rank (tp=1) state with the true vocabulary, so a
checkpoint or a cache built at any layout is the same bytes; ``shard`` and ``merge``
are exact inverses (tested).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
_ROWS = ("self_attention.linear_qkv.weight",)  # whole query groups per rank
_COLUMNS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_GLU = "mlp.linear_fc1.weight"


class LayoutError(ValueError):
    """A model shape the tensor-parallel size cannot split. One line."""


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (each rank holds as many rows)."""
    return -(-vocab // tp) * tp


def check_shape(heads: int, groups: int, tp: int) -> None:
    """Whole heads and whole query groups per rank, or LayoutError."""
    if heads % tp or groups % tp:
        raise LayoutError(
            f"tensor parallel {tp} needs the attention heads ({heads}) and query groups "
            f"({groups}) to be multiples of it"
        )


def split_dim(name: str) -> int | None:
    """The dimension ``name`` splits along (None: whole on every rank)."""
    if name in VOCAB_ROWS or name.endswith(_ROWS) or name.endswith(_GLU):
        return 0
    if name.endswith(_COLUMNS):
        return 1
    return None


def shard_tensor(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of the full tensor ``name`` (vocabulary rows padded with
    zeros first): a contiguous copy of its own, never a view (a view of the full
    tensor would keep all of it alive, and a column slice is strided: fused optimizer
    kernels given strided moments update them wrongly)."""
    dim = split_dim(name)
    if dim is None or tp == 1:
        return full
    if name in VOCAB_ROWS:
        full = _zero_rows_to(full, padded_vocab(full.shape[0], tp))
    if name.endswith(_GLU):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
    if full.shape[dim] % tp:
        raise LayoutError(f"{name}: {full.shape[dim]} rows do not split over {tp} ranks")
    return full.chunk(tp, dim)[rank].clone(memory_format=torch.contiguous_format)


def merge_tensor(name: str, parts: Sequence[torch.Tensor], vocab: int) -> torch.Tensor:
    """The full tensor ``name`` from every rank's part, in rank order (the inverse of
    :func:`shard_tensor`; vocabulary padding removed)."""
    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        full = parts[0]
    elif name.endswith(_GLU):
        halves = [p.chunk(2, 0) for p in parts]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(list(parts), dim)
    return full[:vocab] if name in VOCAB_ROWS else full


def shard(full: Mapping[str, object], rank: int, tp: int) -> dict[str, object]:
    """Rank ``rank``'s state dict from the full one (other entries, e.g. Megatron's
    ``_extra_state``, are kept as they are)."""
    return {
        k: shard_tensor(k, v, rank, tp) if isinstance(v, torch.Tensor) else v
        for k, v in full.items()
    }


def merge(parts: Sequence[Mapping[str, object]], vocab: int) -> dict[str, object]:
    """The full state dict from every rank's, in rank order."""
    out: dict[str, object] = {}
    for k, v in parts[0].items():
        if isinstance(v, torch.Tensor):
            out[k] = merge_tensor(k, [p[k] for p in parts], vocab)  # type: ignore[misc]
        else:
            out[k] = v
    return out


def hf_part(
    name: str, shape: Sequence[int], rank: int, tp: int, dims: Mapping[str, int]
) -> tuple[int, int, int] | None:
    """Which part of the HF Llama tensor ``name`` (of ``shape``) rank ``rank`` needs:
    (dim, start, stop), None for the whole tensor. ``dims``: the model's ``heads``,
    ``groups``, ``head_dim``, ``ffn`` and ``vocab_size``. Whole query groups per rank
    (a group's q heads are contiguous in q_proj), so converting the parts with the
    rank's own head and group counts gives exactly its Megatron part."""
    if tp == 1:
        return None
    rows = {
        "self_attn.q_proj.weight": dims["heads"] * dims["head_dim"],
        "self_attn.k_proj.weight": dims["groups"] * dims["head_dim"],
        "self_attn.v_proj.weight": dims["groups"] * dims["head_dim"],
        "mlp.gate_proj.weight": dims["ffn"],
        "mlp.up_proj.weight": dims["ffn"],
    }
    columns = {
        "self_attn.o_proj.weight": dims["heads"] * dims["head_dim"],
        "mlp.down_proj.weight": dims["ffn"],
    }
    for suffix, n in rows.items():
        if name.endswith(suffix):
            return 0, rank * n // tp, (rank + 1) * n // tp
    for suffix, n in columns.items():
        if name.endswith(suffix):
            return 1, rank * n // tp, (rank + 1) * n // tp
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per = padded_vocab(dims["vocab_size"], tp) // tp  # the last rank's may run past
        return 0, min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
    return None


def pad_vocab_rows(local: dict[str, torch.Tensor], vocab: int, tp: int) -> None:
    """A rank's vocabulary rows read from an HF file, padded with zero rows to its share
    of the padded vocabulary (only the last rank's run short), in place."""
    per = padded_vocab(vocab, tp) // tp
    for name in VOCAB_ROWS:
        if name in local:
            local[name] = _zero_rows_to(local[name], per)


def _zero_rows_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (``t`` itself when it has them)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
