"""Which replica owns each parameter's optimizer state (train/distributed_optimizer.py
``owners``): a pure function of the sizes, so every rank computes the same split."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rlix_async.train.distributed_optimizer import owners


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 8))
def test_every_parameter_has_one_owner_and_the_loads_stay_within_one_parameter(
    sizes: list[int], ranks: int
) -> None:
    got = owners(sizes, ranks)
    assert got == owners(list(sizes), ranks)  # the same on every rank
    assert len(got) == len(sizes) and all(0 <= r < ranks for r in got)
    load = [sum(s for s, r in zip(sizes, got, strict=True) if r == k) for k in range(ranks)]
    # largest first to the least loaded: no rank exceeds another by more than a parameter
    assert max(load) - min(load) <= max(sizes)


def test_a_model_s_parameters_split_about_evenly() -> None:
    # an embedding, then layers of a large and a small matrix and a norm
    sizes = [49152 * 576] + [576 * 1536, 576 * 576, 576] * 30
    got = owners(sizes, 2)
    load = [sum(s for s, r in zip(sizes, got, strict=True) if r == k) for k in range(2)]
    assert max(load) / sum(sizes) < 0.55
