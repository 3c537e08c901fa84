"""A step's batch as tensors: each rank's rows of prompt + response, left-aligned, padded,
and the pieces a step's forward passes take (micro-batches, ``Piece``).

Pure (no device, no model): the trainer moves the result to its device in one go.
Built in host memory because one small copy per row would be a transfer each; every
float is float32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from rlix_async.protocols.batch import Group
from rlix_async.train.algo import group_advantages

NO_ROUTE = 255  # a position the engine recorded no expert for (uint8 routes)


def pack_batch(
    groups: list[Group], rank: int, world: int, routes: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share (every ``world``-th row) of ``groups``' trajectories.

    ``ids`` [B, L] the tokens; ``mask``, ``behavior`` [B, W] per predicted position from
    the first position any row's response needs (the sampler's log-probs, and which
    positions are trained on); ``adv`` [B] each row's group-normalised advantage;
    ``lengths`` [B] each row's tokens before its padding. With ``routes`` (MoE layers,
    top k) and any group carrying them: ``routes`` [B, L, layers, k] uint8, the
    engine's experts per position (``NO_ROUTE`` where it recorded none: padding, the
    last token, a row without routes or whose routes do not fit its length).
    """
    rows: list[tuple[list[int], int, list[float], float, list[int] | None]] = []
    recorded: list[bytes] = []
    for g in groups:
        if g.members:  # several trajectories of one episode: the episodes' advantages
            reward_of = dict(zip(g.members, g.rewards, strict=True))  # alike within one
            per = torch.tensor([reward_of[m] for m in range(len(reward_of))])
            adv = group_advantages(per.float())[torch.tensor(g.members)]
        else:
            adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float32))
        masks: list[list[int] | None] = list(g.masks) or [None] * len(g.responses)
        for resp, lps, a, m in zip(g.responses, g.logprobs, adv.tolist(), masks, strict=True):
            rows.append((g.prompt + resp, len(g.prompt), lps, a, m))
        recorded += g.routes or [b""] * len(g.responses)
    rows, recorded = rows[rank::world], recorded[rank::world]
    longest = max(len(r[0]) for r in rows)
    # Position t predicts token t+1, so responses are predicted from position plen-1
    # on. The per-position tensors (mask, behaviour, and the log-probs made to match
    # them) start at the first position any row's response needs: the prompt's
    # positions before it cost no output layer, softmax or entropy.
    first = min(r[1] for r in rows) - 1
    n = len(rows)
    ids = torch.zeros(n, longest, dtype=torch.long)
    mask = torch.zeros(n, longest - 1 - first, dtype=torch.float32)
    behavior = torch.zeros(n, longest - 1 - first, dtype=torch.float32)
    for i, (seq, plen, lps, _, token_mask) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        # an episode's environment tokens (mask 0) are context, never trained on
        span = slice(plen - 1 - first, len(seq) - 1 - first)
        mask[i, span] = 1.0 if token_mask is None else torch.tensor(token_mask, dtype=torch.float32)
        behavior[i, span] = torch.tensor(lps, dtype=torch.float32)
    adv_rows = torch.tensor([r[3] for r in rows], dtype=torch.float32)
    lengths = torch.tensor([len(r[0]) for r in rows], dtype=torch.long)
    out = {"ids": ids, "mask": mask, "behavior": behavior, "adv": adv_rows, "lengths": lengths}
    if routes is not None and any(recorded):
        out["routes"] = pack_routes(recorded, [len(r[0]) for r in rows], longest, routes)
    return out


def pack_routes(
    recorded: list[bytes], lengths: list[int], longest: int, shape: tuple[int, int]
) -> torch.Tensor:
    """Each row's routes (positions 0 .. length - 2, ``shape`` = (layers, k) each) in a
    [rows, longest, layers, k] uint8 tensor, ``NO_ROUTE`` elsewhere; a row whose bytes
    are not exactly that many positions' gets none (never a misaligned replay)."""
    layers, k = shape
    out = torch.full((len(recorded), longest, layers, k), NO_ROUTE, dtype=torch.uint8)
    for i, (raw, n) in enumerate(zip(recorded, lengths, strict=True)):
        if raw and len(raw) == (n - 1) * layers * k:
            out[i, : n - 1] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(
                n - 1, layers, k
            )
    return out


def minibatch_rows(rows: int, minibatches: int, device: torch.device) -> list[torch.Tensor]:
    """A rank's ``rows`` in order, in exactly min(``minibatches``, ``rows``) parts of
    sizes that differ by at most one (never fewer: replicas whose shares differ by a
    row must make as many optimizer updates, each one a collective)."""
    order = torch.arange(rows, device=device)
    return list(order.tensor_split(max(1, min(minibatches, rows))))


def micro_batches(
    idx: list[int], lengths: list[int], rows: int | None, max_tokens: int | None
) -> list[list[int]]:
    """A minibatch's rows ``idx`` in pieces for gradient accumulation: ``rows`` at a time
    in order, or (``max_tokens``) longest first, each piece at most ``max_tokens``
    tokens counting its padding (rows x its longest row), a longer row alone.
    ``lengths[i]`` is row ``i``'s length. Neither: one piece."""
    if max_tokens is None:
        step = rows or len(idx) or 1
        return [idx[i : i + step] for i in range(0, len(idx), step)]
    pieces: list[list[int]] = []
    for i in sorted(idx, key=lambda i: -lengths[i]):
        # longest first: a piece's first row is its longest
        if pieces and (len(pieces[-1]) + 1) * lengths[pieces[-1][0]] <= max_tokens:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return pieces


Take = Callable[[torch.Tensor], torch.Tensor]


class Piece(NamedTuple):
    """One forward pass of a step: the token ``ids`` (rows x positions), how many of
    their last tokens are predicted (``width``), and what ``take`` does with the logits
    of the ``width`` + 1 positions before them (a loss to backpropagate, or a zero
    after storing log-probs). ``routes``: the engine's experts for ``ids`` (rows x
    positions x MoE layers x k, in host memory; None: the model routes on its own)."""

    ids: torch.Tensor
    width: int
    take: Take
    routes: torch.Tensor | None = None
