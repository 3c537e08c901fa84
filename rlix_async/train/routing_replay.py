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

Before it replays, each router compares its own top k with the engine's in the update
passes (every row once a step; a forward recomputed in the backward not again):
``routing_agreement`` is the fraction of (token, MoE layer) pairs whose expert sets
are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlix_async.train.packing import NO_ROUTE


def _engine_route_class() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class EngineRoute(RouterReplay):  # type: ignore[misc]
        """One router's replay: the engine's experts for the piece in flight, the
        trainer's own where it has none. A forward recomputed inside the backward (full
        recompute) takes its piece's routes from a queue in forward order, as the
        pipeline schedule runs backwards in that order."""

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
            if torch._C._current_autograd_node() is not None:  # recomputed in backward
                target = self.queue.pop(0) if self.queue else None
            else:
                target = self.owner.target(self.column)
                if self.owner.recompute:
                    self.queue.append(target)
            if target is None:
                return probs, own
            engine, valid = (x.to(scores.device) for x in target)
            if self.owner.counting and torch._C._current_autograd_node() is None:
                same = (own.sort(1).values == engine.sort(1).values).all(1) & valid
                self.owner.agree += int(same.sum())
                self.owner.total += int(valid.sum())
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
        self.counting = False
        self.agree = self.total = 0
        self._routes: torch.Tensor | None = None  # the piece's [rows, positions, layers, k]
        self._cached: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise RuntimeError("routing replay: the model was built without it")
                module.router_replay = engine_route(self, column(global_layer(name)))
        # driven router by router: Megatron's class-wide list (every instance ever made,
        # of every model rebuilt) is not this trainer's to keep growing
        RouterReplay.global_router_replay_instances.clear()

    def set(self, routes: torch.Tensor | None) -> None:
        """The routes of the piece whose forward runs next (None: the model's own)."""
        self._routes, self._cached = routes, {}

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
        """``routing_agreement`` over every rank's update passes since the last call
        (absent when none had routes), then reset."""
        import torch.distributed as dist

        counts = torch.tensor([self.agree, self.total], dtype=torch.float64)
        self.agree = self.total = 0
        if dist.is_initialized():
            wire = counts.to(device) if dist.get_backend() == "nccl" else counts
            dist.all_reduce(wire)
            counts = wire.cpu()
        agree, total = counts.tolist()
        return {"routing_agreement": agree / total} if total else {}
