"""Fixed GRPO batches for the tensor-parallel runs (tests/helpers/megatron_tp.py):
two groups per step with rewards that differ within each group, over the tiny model's
vocabulary (below 63). ``ODD_BATCHES``: 7 rows a step, so two replicas' shares
differ by a row (and, a row a micro-batch, in how many passes they run)."""

from __future__ import annotations

from rlix_async.protocols.batch import Group


def _group(prompt: list[int], seed: int) -> Group:
    responses = [[(seed * 7 + i * 5 + j * 3) % 60 + 2 for j in range(4 + i)] for i in range(4)]
    logprobs = [[-3.0 - 0.1 * j for j in range(len(r))] for r in responses]
    versions = [[0] * len(r) for r in responses]
    return Group(prompt, responses, logprobs, versions, [1.0, 0.0, 0.5, 0.25])


BATCHES = [
    [_group([1, 2, 3], 1), _group([4, 5], 2)],
    [_group([6, 7, 8, 9], 3), _group([10, 11], 4)],
    [_group([12, 13], 5), _group([14, 15, 16], 6)],
]


def _odd(groups: list[Group]) -> list[Group]:
    first, second = groups
    cut = Group(
        second.prompt, second.responses[:3], second.logprobs[:3], second.versions[:3],
        second.rewards[:3],
    )  # fmt: skip
    return [first, cut]


ODD_BATCHES = [_odd(b) for b in BATCHES]


def with_routes(batches: list[list[Group]], layers: int, k: int, experts: int) -> list[list[Group]]:
    """``batches`` with engine routes for every response (routing replay): fixed
    pseudo-random experts, k distinct per position and layer, for positions 0 ..
    len(prompt) + len(response) - 2."""
    out = []
    for b, groups in enumerate(batches):
        routed = []
        for g_i, g in enumerate(groups):
            routes = []
            for r_i, r in enumerate(g.responses):
                n = len(g.prompt) + len(r) - 1
                flat = bytearray()
                for t in range(n):
                    for layer in range(layers):
                        first = (b * 7 + g_i * 5 + r_i * 3 + t * 11 + layer * 13) % experts
                        flat += bytes((first + j) % experts for j in range(k))
                routes.append(bytes(flat))
            routed.append(Group(g.prompt, g.responses, g.logprobs, g.versions, g.rewards,
                                routes=routes))  # fmt: skip
        out.append(routed)
    return out
