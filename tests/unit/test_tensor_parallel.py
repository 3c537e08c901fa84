"""How Megatron weights split over tensor-parallel ranks (train/tensor_parallel.py):
pure functions, checked against what the layers compute with their parts."""

from __future__ import annotations

import pytest
import torch

from rlix_async.train.tensor_parallel import (
    LayoutError,
    check_shape,
    merge,
    padded_vocab,
    shard,
    split_dim,
)

HEADS, GROUPS, HEAD_DIM, HIDDEN, FFN, VOCAB = 6, 3, 4, 24, 12, 37


def full_state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    qkv_rows = GROUPS * (HEADS // GROUPS + 2) * HEAD_DIM
    return {
        "embedding.word_embeddings.weight": r(VOCAB, HIDDEN),
        "decoder.layers.0.input_layernorm.weight": r(HIDDEN),
        "decoder.layers.0.self_attention.linear_qkv.weight": r(qkv_rows, HIDDEN),
        "decoder.layers.0.self_attention.linear_qkv._extra_state": None,
        "decoder.layers.0.self_attention.linear_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
        "decoder.layers.0.pre_mlp_layernorm.weight": r(HIDDEN),
        "decoder.layers.0.mlp.linear_fc1.weight": r(2 * FFN, HIDDEN),
        "decoder.layers.0.mlp.linear_fc2.weight": r(HIDDEN, FFN),
        "decoder.final_layernorm.weight": r(HIDDEN),
        "output_layer.weight": r(VOCAB, HIDDEN),
    }


@pytest.mark.parametrize("tp", [1, 3])
def test_shards_merge_back_to_the_full_state_exactly(tp: int) -> None:
    full = full_state()
    parts = [shard(full, r, tp) for r in range(tp)]
    back = merge(parts, VOCAB)
    assert back.keys() == full.keys()
    for k, v in full.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[k], v), k  # type: ignore[arg-type]
        else:
            assert back[k] is v


def test_each_rank_holds_what_its_layers_compute_with() -> None:
    """The SwiGLU of a rank's fc1 part and the sum of the row-parallel parts give the
    one-rank MLP's output; a rank's qkv rows are whole query groups; the vocabulary is
    padded with zero rows to a multiple of tp."""
    tp, full = 3, full_state()
    # float64: only the layout may differ, not the summation order's rounding
    x = torch.randn(5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fc1, fc2 = (
        full["decoder.layers.0.mlp.linear_fc1.weight"],
        full["decoder.layers.0.mlp.linear_fc2.weight"],
    )
    assert isinstance(fc1, torch.Tensor) and isinstance(fc2, torch.Tensor)

    def mlp(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ w1.double().T).chunk(2, -1)  # Megatron's GLU halves its local output
        return (torch.nn.functional.silu(gate) * up) @ w2.double().T

    parts = [shard(full, r, tp) for r in range(tp)]
    summed = sum(
        mlp(
            p["decoder.layers.0.mlp.linear_fc1.weight"], p["decoder.layers.0.mlp.linear_fc2.weight"]
        )  # type: ignore[arg-type]
        for p in parts
    )
    torch.testing.assert_close(summed, mlp(fc1, fc2))  # the row-parallel all-reduce

    per_group = (HEADS // GROUPS + 2) * HEAD_DIM
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert isinstance(qkv, torch.Tensor)
    for r, p in enumerate(parts):
        mine = p["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert torch.equal(mine, qkv[r * per_group : (r + 1) * per_group])  # type: ignore[arg-type]
        emb = p["embedding.word_embeddings.weight"]
        assert emb.shape[0] == padded_vocab(VOCAB, tp) // tp  # type: ignore[union-attr]
    last = parts[-1]["embedding.word_embeddings.weight"]
    pad = padded_vocab(VOCAB, tp) - VOCAB
    assert pad and torch.equal(last[-pad:], torch.zeros(pad, HIDDEN))  # type: ignore[index]


def test_layout_rules() -> None:
    assert split_dim("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert split_dim("decoder.layers.3.mlp.linear_fc1.weight") == 0
    assert split_dim("decoder.layers.3.input_layernorm.weight") is None
    assert padded_vocab(49152, 3) == 49152 and padded_vocab(37, 2) == 38
    check_shape(9, 3, 3)  # SmolLM2-135M: tensor parallel 1 or 3
    with pytest.raises(LayoutError, match="attention heads \\(9\\) and query groups \\(3\\)"):
        check_shape(9, 3, 2)


def test_a_rank_part_is_a_compact_copy_of_its_own() -> None:
    """Strided moments (a column slice) make torch's fused AdamW update them wrongly, and
    a view would keep the whole tensor alive on every rank."""
    full = full_state()
    for name, part in shard(full, 1, 2).items():
        if isinstance(part, torch.Tensor) and split_dim(name) is not None:
            assert part.is_contiguous(), name
            assert part.untyped_storage().data_ptr() != full[name].untyped_storage().data_ptr()  # type: ignore[union-attr]


def test_a_ranks_slices_of_the_hf_file_convert_to_its_part_exactly() -> None:
    """Loading reads only a rank's slices of each HF tensor (hf_part) and converts them
    with the rank's own head and group counts: the result is exactly that rank's part
    of the whole model, padding rows included."""
    from rlix_async.train.megatron_hf import hf_to_megatron, megatron_to_hf
    from rlix_async.train.tensor_parallel import hf_part, pad_vocab_rows

    whole = {k: v for k, v in full_state(seed=2).items() if isinstance(v, torch.Tensor)}
    hf = megatron_to_hf(whole, HEADS, GROUPS, HEAD_DIM)
    dims = {"heads": HEADS, "groups": GROUPS, "head_dim": HEAD_DIM, "ffn": FFN, "vocab_size": VOCAB}
    tp = 3  # one query group per rank; the vocabulary of 37 padded to 39
    for rank in range(tp):
        parts = {}
        for name, t in hf.items():
            where = hf_part(name, t.shape, rank, tp, dims)
            if where is None:
                parts[name] = t
            else:
                dim, lo, hi = where
                parts[name] = t[lo:hi] if dim == 0 else t[:, lo:hi]
        local = hf_to_megatron(parts, HEADS // tp, GROUPS // tp, HEAD_DIM, tied=False)
        pad_vocab_rows(local, VOCAB, tp)
        want = shard(whole, rank, tp)
        assert local.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(local[k], v), (rank, k)  # type: ignore[arg-type]
