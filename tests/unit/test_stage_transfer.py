"""The gather's buckets (train/stage_transfer.py): both ends cut a header's tensors
into the same runs of one dtype, each at most the limit unless one tensor alone is
larger, in order and covering every tensor once."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from rlix_async.train.stage_transfer import buckets

F32, BF16 = torch.float32, torch.bfloat16


def test_runs_break_at_a_dtype_change_and_at_the_limit() -> None:
    sizes = [(F32, 10), (F32, 10), (F32, 10), (BF16, 4), (BF16, 100), (F32, 1)]
    # 80 bytes: two float32 tensors of 40 fit, a third does not; a 200-byte bfloat16
    # tensor is alone in its own run
    assert buckets(sizes, limit=80) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5),
                                        range(5, 6)]  # fmt: skip
    assert buckets(sizes, limit=1 << 20) == [range(0, 3), range(3, 5), range(5, 6)]
    assert buckets([], limit=80) == []


@given(
    st.lists(st.tuples(st.sampled_from([F32, BF16]), st.integers(1, 50)), max_size=30),
    st.integers(1, 400),
)
def test_every_tensor_once_in_order_one_dtype_a_run_within_the_limit(
    sizes: list[tuple[torch.dtype, int]], limit: int
) -> None:
    runs = buckets(sizes, limit)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    for r in runs:
        assert len({sizes[i][0] for i in r}) == 1
        used = sum(sizes[i][1] * sizes[i][0].itemsize for i in r)
        assert used <= limit or len(r) == 1
