"""Routing replay: a mixture-of-experts policy's routers pick the experts the engine's
routers picked for the same tokens (train.routing_replay, "R3").

The engine and the trainer compute the same router logits in different orders of
summation (other kernels, other precision): where two experts are near a tie the
trainer can send a token through other experts than the one that sampled it, and that
token's importance ratio is then no longer about the policy's change. The shards
record each token's experts (``Group.routes``); here each of the policy's routers
takes them through Megatron's ``RouterReplay`` hook (``moe_enable_routing_replay``):
the top k indices replaced, the gate weights still the trainer's own softmax over
them (so the router keeps its gradient). Positions the engine recorded nothing for
(padding, the last token, rows without routes) keep the trainer's own choice.

Before it replays, each router compares its own top k with the engine's at the step's
starting weights (the pi_old pass and the first update pass, which is pi_old's too:
every row once a step, before any update moved a router): ``routing_agreement`` is
the fraction of (token, MoE layer) pairs whose expert sets are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlix_async.train.megatron_moe import sum_over_ranks
from rlix_async.train.packing import NO_ROUTE


def _engine_route_class() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class EngineRoute(RouterReplay):  # type: ignore[misc]
        """One router's replay: the engine's experts for the piece in flight, the
        trainer's own where it has none. Under full recompute an update pass's forward
        queues its piece's routes and the forward recomputed inside the backward takes
        them in that order, as the pipeline schedule runs backwards (only update
        passes are checkpointed: Megatron recomputes in training mode only)."""

        def __init__(self, owner: RouteReplay, column: int) -> None:
            super().__init__()
            self.owner, self.column = owner, column
            self.queue: list[tuple[torch.Tensor, torch.Tensor] | None] = []

        def get_replay_topk(
            self,
            scores: torch.Tensor,
            topk: int,
            num_groups: int | None = None,
            group_topk: int | None = None,
            default_compute_topk: Callable[..., Any] | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            assert default_compute_topk is not None
            probs, own = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            recomputed = torch._C._current_autograd_node() is not None
            if recomputed:  # inside the backward: the piece its forward queued
                if not self.queue:
                    raise RuntimeError("routing replay: a recomputed forward without routes")
                target = self.queue.pop(0)
            else:
                target = self.owner.target(self.column)
                if self.owner.recompute and self.owner.updating:
                    self.queue.append(target)
            if target is None:
                return probs, own
            engine, valid = (x.to(scores.device) for x in target)
            if self.owner.counting and not recomputed:
                same = (own.sort(1).values == engine.sort(1).values).all(1) & valid
                self.owner.count(same.sum(), valid.sum())
            chosen = torch.where(valid[:, None], engine, own)
            return scores.gather(1, chosen), chosen

    return EngineRoute


class RouteReplay:
    """The engine's routes into ``model``'s routers. ``column(layer)``: the routes'
    MoE-layer column of the full model's layer ``layer``; ``global_layer(name)``: the
    full model's layer of a router module's name (a pipeline stage holds some
    layers). ``recompute``: the backward recomputes forwards (full recompute)."""

    def __init__(
        self,
        model: torch.nn.Module,
        global_layer: Callable[[str], int],
        column: Callable[[int], int],
        recompute: bool,
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        engine_route = _engine_route_class()
        self.recompute = recompute
        self.updating = False  # in an update pass (forward and backward)
        # in a pass at the step's starting weights (pi_old's): each row's agreement is
        # counted once a step, before any update moved the router
        self.counting = False
        self.updates_this_step = 0
        # (agreeing, recorded) (token, layer) pairs, on the device until ``stats``
        self._counts: torch.Tensor | None = None
        self._routers: list[Any] = []
        self._routes: torch.Tensor | None = None  # the piece's [rows, positions, layers, k]
        self._cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise RuntimeError("routing replay: the model was built without it")
                module.router_replay = engine_route(self, column(global_layer(name)))
                self._routers.append(module.router_replay)
        # driven router by router: Megatron's class-wide list (every instance ever made,
        # of every model rebuilt) is not this trainer's to keep growing
        RouterReplay.global_router_replay_instances.clear()

    def set(self, routes: torch.Tensor | None) -> None:
        """The routes of the piece whose forward runs next (None: the model's own)."""
        self._routes, self._cached = routes, {}

    def end_pass(self, check: bool = True) -> None:
        """A pass is over: every recomputed forward took its routes (else a queue
        would carry them into the next pass's backward: refused when ``check``)."""
        self.set(None)
        self.updating = self.counting = False
        left = sum(len(r.queue) for r in self._routers)
        for r in self._routers:
            r.queue.clear()
        if left and check:
            raise RuntimeError(f"routing replay: {left} queued routes no backward took")

    def count(self, agree: torch.Tensor, recorded: torch.Tensor) -> None:
        """Add a router's pairs (device tensors: no host sync per layer and piece)."""
        pair = torch.stack([agree, recorded]).to(torch.float64)
        self._counts = pair if self._counts is None else self._counts + pair

    def target(self, column: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Column ``column``'s experts for the piece in flight as the router sees its
        tokens (sequence-major: position by position, rows within), with which of
        them the engine recorded; None: no routes."""
        if self._routes is None:
            return None
        if column not in self._cached:
            rows, positions = self._routes.shape[:2]
            per = self._routes[:, :, column, :].transpose(0, 1).reshape(rows * positions, -1)
            valid = (per != NO_ROUTE).all(1)
            self._cached[column] = (per.long(), valid)
        return self._cached[column]

    def stats(self, device: torch.device) -> dict[str, float]:
        """``routing_agreement`` over every rank's counted passes since the last call
        (a step; absent when none had routes), then reset."""
        counts = sum_over_ranks(self._counts, (2,), device)
        self._counts, self.updates_this_step = None, 0
        agree, total = counts.tolist()
        return {"routing_agreement": agree / total} if total else {}
