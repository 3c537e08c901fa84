"""How a minibatch is cut into micro-batches (train/packing.py): pure, no model."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from rlix_async.train.packing import micro_batches


def test_rows_are_cut_in_order_and_one_piece_without_a_rule() -> None:
    assert micro_batches([4, 1, 3, 0, 2], [1] * 5, 2, None) == [[4, 1], [3, 0], [2]]
    assert micro_batches([4, 1, 3], [1] * 5, None, None) == [[4, 1, 3]]


def test_a_token_budget_packs_longest_first_and_a_long_row_alone() -> None:
    lengths = [8, 3, 8, 3, 30, 3]
    assert micro_batches(list(range(6)), lengths, None, 16) == [[4], [0, 2], [1, 3, 5]]


@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=40),
    st.integers(1, 200),
)
def test_every_row_once_and_each_piece_within_the_budget(lengths: list[int], budget: int) -> None:
    idx = list(range(len(lengths)))
    pieces = micro_batches(idx, lengths, None, budget)
    assert sorted(i for p in pieces for i in p) == idx
    for p in pieces:
        # padding counts: a piece costs its rows times its longest row
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= budget


@given(st.integers(1, 40), st.integers(1, 8))
def test_a_ranks_rows_make_exactly_min_minibatches_rows_parts(rows: int, minibatches: int) -> None:
    """Never fewer parts than asked (torch.chunk makes 3 of 5 rows in 4): replicas whose
    shares differ by a row make as many updates, each one a collective."""
    from rlix_async.train.packing import minibatch_rows

    parts = minibatch_rows(rows, minibatches, torch.device("cpu"))
    assert len(parts) == min(rows, minibatches)
    assert torch.cat(parts).tolist() == list(range(rows))
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
