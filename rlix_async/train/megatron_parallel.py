"""How a megatron-core GPTModel runs over tensor x pipeline x data parallel ranks: the
megatron backend's :class:`~rlix_async.train.policy_update.ModelParallel`.

``tp`` x ``pp`` consecutive ranks hold one replica (Megatron's order tp-pp-dp). At
pipeline parallel 1 pieces run one by one and replicas average their gradients
under torch DDP (:class:`~rlix_async.train.data_parallel.DataParallel`); at P > 1
they go through Megatron's 1F1B schedule, whose interleaving defeats DDP's
forward-time decision, so the replicas' gradients are averaged after it. The last
stage computes every loss and log-prob, from each tensor-parallel rank's vocabulary
slice of the logits (``train/vocab_parallel.py``; gathered under top-p, which sorts
the whole vocabulary). The gradient norm counts every weight once over the
model-parallel group; a tied embedding's two copies sum their gradients over the
embedding group. With the distributed optimizer each replica steps its share of the
parameters and sends those weights to the others (``train/distributed_optimizer.py``).
Under expert parallel (an MoE model's experts shared out over ``ep`` replicas, in
Megatron's tp-ep-dp-pp order) DDP is off: the dense gradients are averaged over the
replicas and each expert's over its own replicas, and every expert rank runs as many
pieces (each MoE layer's forward and backward exchange tokens among them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlix_async.protocols.topology import trainer_place
from rlix_async.train.data_parallel import DataParallel
from rlix_async.train.distributed_optimizer import ParameterOwners
from rlix_async.train.megatron_model import rebind_groups, run_model, seed_rng_tracker
from rlix_async.train.packing import Piece
from rlix_async.train.routing_replay import RouteReplay
from rlix_async.train.vocab_parallel import vocab_parallel_logp


class MegatronLayout:
    """Where a rank sits in the tp x pp x dp layout (x ep: a replica's experts split
    over ``ep`` replicas; ``protocols.topology.trainer_place``), and Megatron's parallel
    state over a fresh group for it."""

    def __init__(
        self, rank: int, world: int, tp: int, pp: int, device: torch.device, ep: int = 1
    ) -> None:
        self.rank, self.world, self.tp, self.pp, self.ep = rank, world, tp, pp, ep
        self.device = device
        place = trainer_place(rank, world, tp, pp, ep)
        self.tp_rank, self.stage, self.ep_rank = place.tp, place.pp, place.ep
        self.dp_rank, self.dp_world = place.dp, world // (tp * pp)
        # without expert parallel: tp x pp consecutive ranks per replica (the launcher's
        # layout); with it Megatron's default order (no other splits experts over
        # replicas at pp > 1)
        self.order = "tp-pp-dp" if ep == 1 else "tp-ep-dp-pp"
        self.group_gen = 0

    @property
    def model_parallel(self) -> bool:
        """Whether a rank holds part of the model only (a replica spans several ranks,
        or its experts do)."""
        return self.tp * self.pp * self.ep > 1

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        """The rank at (``stage``, replica ``dp_rank``, ``tp_rank``): the inverse of
        ``trainer_place``."""
        if self.ep == 1:
            return tp_rank + self.tp * (stage + self.pp * dp_rank)
        return tp_rank + self.tp * (dp_rank + self.dp_world * stage)

    def dp_group(self) -> dist.ProcessGroup | None:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group() if self.model_parallel else None

    def init(
        self,
        store: dist.Store | None,
        models: list[torch.nn.Module],
        seed: int,
        backend: str | None = None,
    ) -> None:
        """Megatron's parallel state over a fresh group on ``store`` (None: a private
        one-rank group); ``backend`` by default NCCL on CUDA, gloo on CPU; ``models``
        (the GPTModels built so far) rebound to the new groups."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            self.group_gen += 1
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: the pipeline trains in one
            dist.init_process_group(
                backend or ("nccl" if self.device.type == "cuda" else "gloo"),
                store=dist.PrefixStore(f"rlix-mg-{self.group_gen}", store or dist.HashStore()),
                rank=self.rank if store is not None else 0,
                world_size=self.world if store is not None else 1,
            )
        if not parallel_state.model_parallel_is_initialized():
            alone = store is None
            parallel_state.initialize_model_parallel(
                1 if alone else self.tp,
                1 if alone else self.pp,
                expert_model_parallel_size=1 if alone else self.ep,
                order="tp-pp-dp" if alone else self.order,
            )
            rebind_groups(models)
        seed_rng_tracker(seed)

    def destroy(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


class MegatronParallel:
    """The step's parallel part for ``layout``; ``vocab``: the true vocabulary size
    (the padded one's extra rows are cut or set to -inf); ``tied``: the output layer
    shares the embedding."""

    def __init__(
        self,
        layout: MegatronLayout,
        *,
        vocab: int,
        tied: bool,
        temperature: float,
        top_p: float,
        max_grad_norm: float,
    ) -> None:
        self.layout = layout
        self.dp_rank, self.dp_world = layout.dp_rank, layout.dp_world
        self.vocab, self.tied = vocab, tied
        self.temperature, self.top_p = temperature, top_p
        self.max_grad_norm = max_grad_norm
        self.owners: ParameterOwners | None = None  # the distributed optimizer's shares
        self.model: torch.nn.Module | None = None  # the policy (its tied embedding's grads)
        self.replay: RouteReplay | None = None  # an MoE policy replaying the engine's routes
        # pipeline parallel 1: one stage per replica, DDP over the replicas
        self.data = DataParallel(
            layout.device,
            layout.dp_rank,
            layout.dp_world,
            temperature=temperature,
            top_p=top_p,
            max_grad_norm=max_grad_norm,
            logits=self.stage_logits,
            group=layout.dp_group,
        )

    @property
    def vocab_parallel(self) -> bool:
        """Whether each tensor-parallel rank keeps its own vocabulary slice of the
        logits (train/vocab_parallel.py) rather than gathering them: not under top-p,
        which sorts the whole vocabulary."""
        return self.layout.tp > 1 and self.top_p >= 1.0

    def share(
        self, trainable: list[torch.nn.Parameter], distributed: bool
    ) -> list[torch.nn.Parameter]:
        """The parameters this rank's optimizer keeps state for and steps: all of
        ``trainable``, or with the distributed optimizer this replica's share."""
        if not distributed or self.dp_world == 1:
            return trainable
        lay = self.layout
        if lay.ep > 1:  # config validation refuses it first: expert state is not split yet
            raise ValueError("the distributed optimizer does not shard expert state (ep > 1)")
        ranks = [lay.rank_of(lay.stage, d, lay.tp_rank) for d in range(self.dp_world)]
        self.owners = ParameterOwners(trainable, self.dp_rank, ranks)
        return self.owners.mine

    def logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Every position's logits: the true vocabulary's, or this rank's slice."""
        if self.vocab_parallel:
            return run_model(model, ids, gather=False)
        return run_model(model, ids)[..., : self.vocab]

    def stage_logits(self, model: torch.nn.Module, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """The last ``keep`` positions' logits, one stage only: under pipeline parallel
        pieces go through :meth:`forward` (Megatron computes every position's)."""
        if self.layout.pp > 1:
            raise RuntimeError("one stage's logits under pipeline parallel: use forward()")
        return self.logits(model, ids)[:, -keep:]

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.layout.dp_group()

    def training_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.data.training_model(model)

    @property
    def manual_reduce(self) -> bool:
        """Whether gradients are averaged after the backward (``_reduce_grads``) rather
        than by DDP: under the pipeline schedule, and with expert parallel (DDP would
        average each rank's experts with other ranks' different ones)."""
        return self.layout.pp > 1 or self.layout.ep > 1

    def grads_averaged(self) -> bool:
        return self.data.grads_averaged() or (self.manual_reduce and self.dp_world > 1)

    def after_optim_step(self) -> None:
        if self.owners is not None:  # each replica stepped its share: every weight to all
            self.owners.broadcast(self.dp_group())

    def token_logp(
        self, logits: torch.Tensor, ids: torch.Tensor, width: int, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.vocab_parallel:  # the whole vocabulary's logits, as one rank has them
            return self.data.token_logp(logits, ids, width, with_entropy)
        return vocab_parallel_logp(
            logits[:, :-1],
            ids[:, -width:],
            temperature=self.temperature,
            vocab=self.vocab,
            with_entropy=with_entropy,
        )

    def forward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        pieces = self._in_step(pieces, backward=False)
        if self.replay is not None:  # the policy's pi_old pass (not the reference's)
            self.replay.counting = model is self.model
        self._run(model, pieces, backward=False)

    def forward_backward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        pieces = self._in_step(pieces, backward=True)
        if self.replay is not None:
            self.replay.updating = True
            # the first update is at pi_old's weights (its pass gives pi_old): counted
            self.replay.counting = self.replay.updates_this_step == 0
            self.replay.updates_this_step += 1
        self._run(model, pieces, backward=True)
        if self.manual_reduce:
            self._reduce_grads()

    def _run(self, model: torch.nn.Module, pieces: list[Piece], backward: bool) -> None:
        """One pass over ``pieces``: one by one at pipeline parallel 1, else through
        the schedule; the replayed routes' pass ended either way (after a failure
        cleared, the failure reported)."""
        try:
            if self.layout.pp > 1:
                self._schedule(model, pieces, forward_only=not backward)
            elif backward:
                self.data.forward_backward(model, pieces, self._before)
            else:
                self.data.forward(model, pieces, self._before)
        except BaseException:
            if self.replay is not None:
                self.replay.end_pass(check=False)
            raise
        if self.replay is not None:
            self.replay.end_pass()

    def _before(self, piece: Piece) -> None:
        """The routes the next piece's forward replays."""
        if self.replay is not None:
            self.replay.set(piece.routes)

    def _in_step(self, pieces: list[Piece], backward: bool) -> list[Piece]:
        """``pieces``, padded under expert parallel to as many as the most any replica
        runs: every forward and backward pass of an MoE layer exchanges tokens with the
        other expert-parallel ranks, so a rank with fewer pieces (shares differ by a
        row) would leave them waiting. A padding piece is two tokens whose loss is
        zero times the logits: no gradient, no figure."""
        if self.layout.ep == 1:
            return pieces
        most = torch.tensor([len(pieces)], device=self.layout.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group())
        filler = torch.zeros((1, 2), dtype=torch.long, device=self.layout.device)

        def nothing(logits: torch.Tensor) -> torch.Tensor:
            return logits.float().sum() * 0 if backward else logits.new_zeros(())

        return pieces + [Piece(filler, 1, nothing)] * (int(most) - len(pieces))

    def _schedule(self, model: torch.nn.Module, pieces: list[Piece], forward_only: bool) -> None:
        """Megatron's 1F1B pipeline schedule over ``pieces`` (each stage runs its layers;
        the last one hands each piece's logits to its ``take`` and backpropagates what
        that returns, unless ``forward_only``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        vocab = None if self.vocab_parallel else self.vocab
        one = torch.ones((), dtype=torch.int)

        def step(it: Any, stage_model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            piece = next(it)
            self._before(piece)
            out = run_model(stage_model, piece.ids, gather=vocab is not None)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                # calculate_per_token_loss: the schedule neither divides nor scales it
                return piece.take(logits[:, -(piece.width + 1) :, :vocab]), one, {}

            return out, loss_func

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(pieces),
            model=[model],
            num_microbatches=len(pieces),
            seq_length=0,  # variable_seq_lengths: each piece's shape crosses with it
            micro_batch_size=0,
            forward_only=forward_only,
        )

    def _reduce_grads(self) -> None:
        """After the backward: the replicas' gradients averaged (one flat buffer per
        dtype) and a tied embedding's two copies' gradients summed over the embedding
        group (first and last stage). Under expert parallel a rank's experts are
        averaged only with their own replicas (the expert-data-parallel group), over
        all ``dp_world`` replicas' tokens all the same: each expert's gradient already
        sums what every replica's tokens routed to it gave (Megatron's scaling)."""
        from megatron.core import parallel_state

        assert self.model is not None  # set by the trainer before any step
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:  # an expert no token reached: zeros keep buffers aligned
                p.grad = torch.zeros_like(p)
            (dense if getattr(p, "allreduce", True) else experts).append(p.grad)
        if self.dp_world > 1:
            _average(dense, self.dp_group(), self.dp_world)
        if experts and parallel_state.get_expert_data_parallel_world_size() > 1:
            _average(experts, parallel_state.get_expert_data_parallel_group(), self.dp_world)
        elif experts and self.dp_world > 1:  # no replica of them: the division alone
            torch._foreach_div_(experts, float(self.dp_world))
        if self.tied and parallel_state.is_rank_in_embedding_group():
            weight = self.model.shared_embedding_or_output_weight()  # type: ignore[operator]
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def clip_grads(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        if not self.layout.model_parallel:
            return self.data.clip_grads(params)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        # each split weight's squares once per rank, each whole one (the same on every
        # rank of a stage) only on tensor-parallel rank 0, a tied embedding's last-stage
        # copy (``shared``) never: summed over the stages' ranks, every weight once
        # an expert's (``allreduce`` False) are split over expert parallel too: summed
        # over the ranks that hold different experts, the expert group's
        grads = [(p, p.grad) for p in params if p.grad is not None]
        squares = torch.zeros(2, dtype=torch.float32, device=self.layout.device)
        for p, g in grads:
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                squares[int(not getattr(p, "allreduce", True))] += g.float().pow(2).sum()
        dist.all_reduce(squares[:1], group=parallel_state.get_model_parallel_group())
        if self.layout.ep > 1:
            group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            dist.all_reduce(squares[1:], group=group)
        norm = squares.sum().sqrt()
        if torch.isfinite(norm):
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for _, g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    def from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        """The step's figures as the last stage computed them (only it sees logits)."""
        from megatron.core import parallel_state

        keys = sorted(stats)
        values = torch.tensor(
            [stats[k] for k in keys], dtype=torch.float64, device=self.layout.device
        )
        dist.broadcast(
            values,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return dict(zip(keys, values.tolist(), strict=True))


def _average(grads: list[torch.Tensor], group: dist.ProcessGroup | None, over: int) -> None:
    """``grads`` summed over ``group`` and divided by ``over``, one flat buffer per
    dtype."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        flat.div_(over)
        for g, r in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            g.copy_(r)
