"""Where a trainer rank sits (protocols/topology.trainer_place) is where Megatron's own
rank generators put it: the dry run's table, the trainer's groups and its checkpoint
slices all read trainer_place, so a drift from Megatron would mislabel every one."""

from __future__ import annotations

import pytest

from rlix_async.protocols.topology import ClusterSpec, TrainerPlace, trainer_place


def _position(groups: list[list[int]], rank: int) -> int:
    """``rank``'s index in the one group of ``groups`` that holds it."""
    (index,) = [g.index(rank) for g in groups if rank in g]
    return index


@pytest.mark.parametrize(
    ("world", "tp", "pp", "ep"),
    [(2, 1, 1, 2), (4, 1, 2, 2), (4, 1, 1, 2), (8, 1, 2, 2), (8, 2, 2, 2), (4, 2, 2, 1),
     (8, 2, 1, 1)],
)  # fmt: skip
def test_trainer_place_is_megatrons_rank_order(world: int, tp: int, pp: int, ep: int) -> None:
    """The generators as initialize_model_parallel builds them (context parallel 1): the
    dense one for tp, pp and dp, the experts' one (expert tensor parallel = tp, its
    default) for ep and the experts' dp, in the order the trainer passes."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    order = "tp-pp-dp" if ep == 1 else "tp-ep-dp-pp"
    dp, edp = world // (tp * pp), world // (tp * pp * ep)
    dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order, rank_offset=0)
    experts = ps.RankGenerator(tp=tp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=0)
    # Megatron's own conditions on these layouts (initialize_model_parallel asserts them)
    assert order.endswith("pp") or pp == 1 or edp == dp
    assert dense.get_ranks("pp") == experts.get_ranks("pp")
    groups = {
        "tp": dense.get_ranks("tp"), "pp": dense.get_ranks("pp"), "dp": dense.get_ranks("dp"),
        "ep": experts.get_ranks("ep"), "edp": experts.get_ranks("dp"),
    }  # fmt: skip
    for rank in range(world):
        want = TrainerPlace(**{k: _position(g, rank) for k, g in groups.items()})
        assert trainer_place(rank, world, tp, pp, ep) == want, rank
        # the experts' tensor-parallel group is the dense one: same tp index either way
        assert _position(experts.get_ranks("tp"), rank) == want.tp


def test_a_cluster_without_ep_is_not_expert_parallel() -> None:
    """ep comes after pp, so the positional form (tp, devices) keeps its meaning."""
    spec = ClusterSpec(2, (0, 1, 2, 3))
    assert (spec.tp, spec.devices, spec.pp, spec.ep) == (2, (0, 1, 2, 3), 1, 1)
