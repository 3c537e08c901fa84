"""The Megatron-core trainer backend: a Llama-shaped ``GPTModel``, exported under HF names.

Same interface and time-sharing cycle as :class:`TorchTrainer`, with Megatron's
parallel state built and destroyed with each step's group. HF Llama-family weights
come in through ``hf_to_megatron`` and leave through ``megatron_to_hf`` (vLLM's
loader takes those names); other families are refused by :func:`llama_shape`.

Model parallel: ``tp`` x ``pp`` consecutive ranks hold one replica (Megatron's order
tp-pp-dp), split as ``train/tensor_parallel.py`` and ``train/pipeline_parallel.py``
say; replicas are data parallel (torch DDP at pp=1; after the 1F1B schedule under
pipeline parallel, whose interleaving defeats DDP's forward-time decision), with the
optimizer state optionally sharded over them (``train/distributed_optimizer.py``).
The last stage computes every loss and log-prob, from each tensor-parallel rank's
vocabulary slice of the logits (``train/vocab_parallel.py``; gathered under top-p),
and broadcasts the step's figures. The gradient norm counts every weight once over
the model-parallel group; a tied embedding's two copies sum their gradients over the
embedding group. After every step the first replica gathers the whole model onto rank
0 for the weight cache (``stage_transfer.gather_model``); checkpoints are sharded,
each rank writing its own part (``train/sharded_checkpoint.py``), and resume at any
layout (``step_N.pt`` files from one rank load too). On CPU it needs
``megatron_cpu_compat``; its CUDA RNG tracker is seeded with the parallel state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig, TrainConfig
from rlix_async.models.hf import load_hf_model
from rlix_async.train import sharded_checkpoint
from rlix_async.train.buffer import Group
from rlix_async.train.checkpoints import rng_state
from rlix_async.train.distributed_optimizer import ParameterOwners
from rlix_async.train.megatron_hf import (
    MegatronModelError,
    hf_to_megatron,
    llama_shape,
    megatron_to_hf,
    read_hf_part,
    stage_reads,
)
from rlix_async.train.megatron_model import (
    gpt_model,
    rebind_groups,
    run_model,
    seed_rng_tracker,
    tiny_shape,
)
from rlix_async.train.packing import Piece
from rlix_async.train.pipeline_parallel import (
    EMBEDDING,
    check_layers,
    full_param_order,
    global_name,
    to_stage,
)
from rlix_async.train.precision import cast_floats
from rlix_async.train.sharded_checkpoint import ShardedCheckpoint, sharded_path
from rlix_async.train.stage_transfer import gather_model
from rlix_async.train.tensor_parallel import (
    check_shape,
    pad_vocab_rows,
    shard,
    shard_tensor,
)
from rlix_async.train.trainer import TorchTrainer
from rlix_async.train.vocab_parallel import vocab_parallel_logp


class MegatronTrainer(TorchTrainer):
    _shape: dict[str, Any]  # the GPTModel's shape, set by _build_model

    def __init__(
        self,
        cfg: TrainConfig | None = None,
        model: ModelConfig | None = None,
        *,
        tp: int = 1,
        pp: int = 1,
        store: dist.Store | None = None,
        checkpoint_to: Callable[[int], Path | None] | None = None,
        **kw: Any,
    ) -> None:
        """``tp`` x ``pp`` consecutive ranks per replica; with more than one every rank
        constructs its trainer at the same time, meeting on ``store``.
        ``checkpoint_to(step)``: the path rank 0 will ``save`` the step just trained
        to, None when it is not checkpointed (under model parallel every rank writes
        its part of it while the step's group is up)."""
        world = int(kw.get("world", 1))
        if tp * pp > 1 and (store is None or world % (tp * pp)):
            raise ValueError(
                f"tensor x pipeline parallel {tp} x {pp} needs a store and a multiple of "
                f"{tp * pp} ranks"
            )
        self.tp, self.pp = tp, pp
        self._store = store
        self.checkpoint_to = checkpoint_to or (lambda step: None)
        self._full: dict[str, torch.Tensor] | None = None  # rank 0, model parallel: the whole model
        self._parts_step = -1  # the last step whose parts every rank wrote (sharded checkpoint)
        try:
            super().__init__(cfg, model, **kw)
            if self.model_parallel:
                self._full = self._gather_model()
        finally:
            if self.model_parallel:
                self.destroy_group()

    def _replica(self, rank: int, world: int) -> tuple[int, int]:
        return rank // (self.tp * self.pp), world // (self.tp * self.pp)

    def _optimized(self, trainable: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """All of ``trainable``, or with the distributed optimizer the share this
        replica owns (train/distributed_optimizer.py)."""
        self._owners: ParameterOwners | None = None
        if not self.cfg.distributed_optimizer or self.dp_world == 1:
            return trainable
        span = self.tp * self.pp  # data-parallel rank d's rank: d x span + this offset
        ranks = [d * span + self.rank % span for d in range(self.dp_world)]
        self._owners = ParameterOwners(trainable, self.dp_rank, ranks)
        return self._owners.mine

    def _after_optim_step(self) -> None:
        if self._owners is not None:  # each replica stepped its share: every weight to all
            self._owners.broadcast(self._dp_group())

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are sharded (every rank holds a part no other has)."""
        return self.model_parallel or self._owners is not None

    @property
    def model_parallel(self) -> bool:
        """Whether a replica spans several ranks."""
        return self.tp * self.pp > 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank // self.tp % self.pp

    def _dp_group(self) -> dist.ProcessGroup | None:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group() if self.model_parallel else None

    def _parallel_state(self, store: dist.Store | None, backend: str | None = None) -> None:
        """Megatron's parallel state over a fresh group on ``store`` (None: a private
        one-rank group); ``backend`` by default NCCL on CUDA, gloo on CPU."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            self._group_gen += 1
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: the pipeline trains in one
            dist.init_process_group(
                backend or ("nccl" if self.device.type == "cuda" else "gloo"),
                store=dist.PrefixStore(f"rlix-mg-{self._group_gen}", store or dist.HashStore()),
                rank=self.rank if store is not None else 0,
                world_size=self.world if store is not None else 1,
            )
        if not parallel_state.model_parallel_is_initialized():
            tp, pp = (self.tp, self.pp) if store is not None else (1, 1)
            # tp-pp-dp: a replica is tp x pp consecutive ranks (the launcher's layout)
            parallel_state.initialize_model_parallel(tp, pp, order="tp-pp-dp")
            rebind_groups(self._models())
        seed_rng_tracker(self.seed)

    def _models(self) -> list[torch.nn.Module]:
        """The GPTModels built so far (the policy, the KL reference)."""
        models = (getattr(self, "model", None), getattr(self, "reference", None))
        return [m for m in models if m is not None]

    def _build_model(self) -> torch.nn.Module:
        from rlix_async.train import megatron_cpu_compat

        megatron_cpu_compat.apply()  # before Megatron is imported or used (CPU only)
        path = self.model_cfg.path
        self._shape = llama_shape(path) if path else tiny_shape(self.model_cfg)
        check_shape(self._shape["heads"], self._shape["groups"], self.tp)
        check_layers(self._shape["layers"], self.pp)
        model = self._gpt_model()
        if path:
            self._load_hf(model, path)
        return model

    def _gpt_model(self) -> torch.nn.Module:
        """A GPTModel (this rank's stage and tensor-parallel part) of ``self._shape``,
        seeded initial weights, in the trainer's dtype, in host memory."""
        # building the model needs Megatron's parallel state: a private one-rank group,
        # or under model parallel the real one, up until the constructor's end
        # (gloo: the model is built, loaded and gathered in host memory)
        self._parallel_state(self._store if self.model_parallel else None, "gloo")
        torch.manual_seed(self.seed)
        model = gpt_model(self._shape, self.dtype, self.cfg.recompute, self.tp, self.pp, self.stage)
        if not self.model_parallel:
            self.destroy_group()  # the time-sharing cycle creates groups per step
        return model

    def _full_name(self, local: str) -> str | None:
        """The full model's name of this stage's ``local`` (None: a tied embedding's
        last-stage copy)."""
        s = self._shape
        return global_name(local, self.stage, self.pp, s["layers"], s["tied"])

    def _to_stage(self, full: Mapping[str, object]) -> dict[str, object]:
        s = self._shape
        return to_stage(full, self.stage, self.pp, s["layers"], s["tied"])

    def _load_hf(self, model: torch.nn.Module, path: str) -> None:
        """The directory's weights into ``model``, every parameter accounted for. Under
        model parallel each rank reads only its own stage's tensors and its own slices
        of them from a safetensors directory (its memory holds its part of the model,
        not all of it)."""
        s = self._shape
        wanted = stage_reads(self.stage, self.pp, s["layers"], s["tied"])
        if (
            self.model_parallel
            and (part := read_hf_part(path, s, self.tp_rank, self.tp, wanted)) is not None
        ):
            local = hf_to_megatron(
                part, s["heads"] // self.tp, s["groups"] // self.tp, s["head_dim"], tied=s["tied"]
            )
            mine = self._to_stage(local)
            pad_vocab_rows(mine, s["vocab_size"], self.tp)  # type: ignore[arg-type]
            self._install(model, mine, path, whole=False)
            return
        hf = load_hf_model(path, torch.float32)
        weights = hf_to_megatron(
            hf.state_dict(), s["heads"], s["groups"], s["head_dim"], tied=s["tied"]
        )
        del hf
        self._install(model, weights, path)

    def _install(
        self,
        model: torch.nn.Module,
        state: Mapping[str, object],
        source: object,
        whole: bool = True,
    ) -> None:
        """The full (tp=1/pp=1) ``state``, this rank's part of it (``whole=False``:
        ``state`` is that part already), into ``model``; every parameter accounted for."""
        mine = shard(self._to_stage(state), self.tp_rank, self.tp) if whole else dict(state)
        mine = {k: v for k, v in mine.items() if v is not None}
        missing, unexpected = model.load_state_dict(mine, strict=False)
        missing = [k for k in missing if "_extra_state" not in k]  # TE/fp8 metadata
        if missing or unexpected:
            raise MegatronModelError(
                f"{source}: weights do not fit the Megatron model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )

    def _frozen_copy(self) -> torch.nn.Module:
        # deepcopy cannot copy the process groups Megatron's modules hold: build another
        # (not from the checkpoint again: the policy's weights are the ones to copy)
        reference = self._gpt_model()
        reference.load_state_dict(self.model.state_dict())
        where = next(self.model.parameters()).device
        return reference.to(where).eval().requires_grad_(False)

    def init_group(self, store: dist.Store | None) -> None:
        self._require_on_device("init_group()")
        self._parallel_state(store if self.world > 1 else None)
        if self.dp_world > 1 and self.pp == 1:
            self._wrap_ddp()

    def destroy_group(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super().destroy_group()  # DDP, then the default group

    @property
    def _vocab_parallel(self) -> bool:
        """Whether each tensor-parallel rank keeps its own vocabulary slice of the
        logits (train/vocab_parallel.py) rather than gathering them: not under top-p,
        which sorts the whole vocabulary."""
        return self.tp > 1 and self.top_p >= 1.0

    def _logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The logits ``run_model`` gives: the true vocabulary's, or this rank's slice."""
        if self._vocab_parallel:
            return run_model(model, ids, gather=False)
        return run_model(model, ids)[..., : self._shape["vocab_size"]]

    def forward_logits(
        self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None
    ) -> torch.Tensor:
        """Megatron's GPTModel computes every position's logits; the last ``keep`` are
        returned (under tensor parallel without top-p, this rank's vocabulary slice).
        One stage: under pipeline parallel, pieces go through ``_forward``."""
        if self.pp > 1:
            raise RuntimeError("forward_logits() under pipeline parallel: use _forward()")
        logits = self._logits(model, ids)
        return logits if keep is None else logits[:, -keep:]

    def _token_logp(
        self, logits: torch.Tensor, ids: torch.Tensor, width: int, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self._vocab_parallel:
            return super()._token_logp(logits, ids, width, with_entropy)
        return vocab_parallel_logp(
            logits[:, :-1],
            ids[:, -width:],
            temperature=self.temperature,
            vocab=self._shape["vocab_size"],
            with_entropy=with_entropy,
        )

    def _forward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        if self.pp == 1:
            super()._forward(model, pieces)
        else:
            self._schedule(model, pieces, forward_only=True)

    def _forward_backward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        if self.pp == 1:
            super()._forward_backward(model, pieces)
            return
        self._schedule(model, pieces, forward_only=False)
        self._reduce_grads()

    def _schedule(self, model: torch.nn.Module, pieces: list[Piece], forward_only: bool) -> None:
        """Megatron's 1F1B pipeline schedule over ``pieces`` (each stage runs its layers;
        the last one hands each piece's logits to its ``take`` and backpropagates what
        that returns, unless ``forward_only``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        vocab = None if self._vocab_parallel else self._shape["vocab_size"]
        one = torch.ones((), dtype=torch.int)

        def step(it: Any, stage_model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            piece = next(it)
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

    def _grads_averaged(self) -> bool:
        return self._ddp is not None or (self.pp > 1 and self.dp_world > 1)

    def _reduce_grads(self) -> None:
        """After a pipelined backward: the replicas' gradients averaged over the
        data-parallel group (one flat buffer per dtype) and a tied embedding's two
        copies' gradients summed over the embedding group (first and last stage)."""
        from megatron.core import parallel_state
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if self.dp_world > 1:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in self.model.parameters():
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
            for grads in by_dtype.values():
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self._dp_group())
                flat.div_(self.dp_world)
                for g, r in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    g.copy_(r)
        if self._shape["tied"] and parallel_state.is_rank_in_embedding_group():
            weight = self.model.shared_embedding_or_output_weight()  # type: ignore[operator]
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        if not dist.is_initialized():  # running alone: a private one-rank group
            if self.model_parallel:
                raise RuntimeError("a model-parallel step needs init_group(store) first")
            self._parallel_state(None)
            try:
                return super().train_step(groups)
            finally:
                self.destroy_group()
        stats = super().train_step(groups)
        if self.pp > 1:
            stats = self._from_last_stage(stats)
        if self.model_parallel:  # while the group is up: the weight cache needs it whole
            t0 = time.perf_counter()
            self._full = self._gather_model()
            self.step_times["time_gather_s"] = round(time.perf_counter() - t0, 4)
        if self.sharded and (path := self.checkpoint_to(self.step)) is not None:
            t0 = time.perf_counter()
            self._write_part(sharded_path(path))
            self.step_times["time_checkpoint_part_s"] = round(time.perf_counter() - t0, 4)
        return stats

    def _write_part(self, path: Path) -> None:
        """This rank's part of the sharded checkpoint ``path``: the first replica's
        ranks write their model slices and optimizer state, the other replicas' their
        optimizer state when the distributed optimizer shards it (else nothing), under
        the full model's names; rank 0 promotes it in ``save``."""

        def part() -> dict[str, torch.Tensor]:
            return sharded_checkpoint.rank_part(
                self.model.state_dict() if self.dp_rank == 0 else {},
                self.optim.state_dict()["state"],
                self._optim_param_names(),
                self._full_name,
            )

        mine = self.dp_rank == 0 or self._owners is not None
        where = (self.stage, self.tp_rank, self.dp_rank)
        sharded_checkpoint.write_parts(path, self.rank, part if mine else None, where, self.device)
        self._parts_step = self.step

    def _from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        """The step's figures as the last stage computed them (only it sees logits)."""
        from megatron.core import parallel_state

        keys = sorted(stats)
        values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.broadcast(
            values,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return dict(zip(keys, values.tolist(), strict=True))

    def _clip_grads(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        if not self.model_parallel:
            return super()._clip_grads(params)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        # each split weight's squares once per rank, each whole one (the same on every
        # rank of a stage) only on tensor-parallel rank 0, a tied embedding's last-stage
        # copy (``shared``) never: summed over the stages' ranks, every weight once
        grads = [(p, p.grad) for p in params if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, g in grads:
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                squares += g.float().pow(2).sum()
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        norm = squares.sqrt()
        if torch.isfinite(norm):
            coef = (self.cfg.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for _, g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    def _gather_model(self) -> dict[str, torch.Tensor] | None:
        s = self._shape
        return gather_model(
            self.model.state_dict(),
            tp=(self.tp_rank, self.tp),
            stage=(self.stage, self.pp),
            first_replica=self.dp_rank == 0,
            shape=(s["layers"], s["tied"], s["vocab_size"]),
            device=self.device,
        )

    def _param_names(self) -> list[str]:
        """The trainable parameters' names, in the model's order."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _optim_param_names(self) -> list[str]:
        """The names of the parameters the optimizer holds (with the distributed
        optimizer this replica's share), in its order."""
        held = {id(p) for g in self.optim.param_groups for p in g["params"]}
        return [n for n, p in self.model.named_parameters() if id(p) in held]

    def _install_optim(self, by_name: dict[str, dict[str, Any]], group: dict[str, Any]) -> None:
        """The optimizer state of the parameters this rank's optimizer holds, from
        ``by_name`` (this rank's slices by local name); ``group``: lr, betas, ..."""
        names = self._optim_param_names()
        state = {j: by_name[n] for j, n in enumerate(names) if n in by_name}
        group = {**group, "params": list(range(len(names)))}
        TorchTrainer._load_optim(self, {"state": state, "param_groups": [group]})

    def _full_param_names(self) -> list[str]:
        """The whole (tp=1/pp=1) model's, in its optimizer's order."""
        return full_param_order(self._param_names(), self._shape["layers"], self._shape["tied"])

    def _model_state(self) -> dict[str, Any]:
        """The whole (tp=1/pp=1) model in Megatron's names: this rank's own without
        model parallel, else the one gathered onto rank 0 at every step (checkpoints and
        the cache read it)."""
        if not self.model_parallel:
            return self.model.state_dict()
        if self._full is None:
            raise RuntimeError("only rank 0 holds the whole model (gathered at every step)")
        return self._full

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        """Under model parallel: the sharded checkpoint whose parts the ranks wrote as
        the step trained (``checkpoint_to`` named it), completed with the step, the RNG
        state and ``extra`` and promoted; returns its directory."""
        if not self.sharded:
            return super().save(path, extra)
        if self._parts_step != self.step:
            raise RuntimeError(
                f"the parts of step {self.step}'s checkpoint were not written: "
                "checkpoint_to must name it when the step trains"
            )
        s = self._shape
        (group,) = self.optim.state_dict()["param_groups"]  # one: AdamW over every weight
        meta = {
            "tp": self.tp,
            "pp": self.pp,
            "layers": s["layers"],
            "tied": s["tied"],
            "vocab_size": s["vocab_size"],
            "dp": self.dp_world if self._owners is not None else 1,  # optimizer shards
            "step": self.step,
            "rng": rng_state(self.device),
            "param_group": {k: v for k, v in group.items() if k != "params"},
            **extra,
        }
        return sharded_checkpoint.promote(sharded_path(path), meta)

    def load(self, path: Path) -> dict[str, Any]:
        if not path.is_dir():
            return super().load(path)
        ckpt = ShardedCheckpoint(path)
        s = self._shape
        if ckpt.vocab != s["vocab_size"] or int(ckpt.meta["layers"]) != s["layers"]:
            raise MegatronModelError(
                f"{path}: its model has {ckpt.meta['layers']} layers and a vocabulary of "
                f"{ckpt.vocab}, this one {s['layers']} and {s['vocab_size']}"
            )
        # this stage's tensors under their local names, from the full model's names
        wanted = self._to_stage({name: name for name in ckpt.model_names()})
        local = {k: ckpt.part(str(name), self.tp_rank, self.tp) for k, name in wanted.items()}
        self._install(self.model, local, path, whole=False)
        # only what this rank's optimizer holds; a tied embedding's last-stage copy
        # starts from the embedding's state
        names = {n: self._full_name(n) or EMBEDDING for n in self._optim_param_names()}
        self._install_optim(ckpt.rank_optim(names, self.tp_rank, self.tp), ckpt.meta["param_group"])
        self._resume_at(ckpt.meta["step"], ckpt.meta["rng"])
        if self.model_parallel and self.rank == 0:
            self._full = ckpt.full_model()
        return ckpt.meta

    def _load_model(self, path: Path, ckpt: dict[str, Any]) -> None:
        """A ``step_N.pt`` checkpoint holds the whole (tp=1/pp=1) model whatever its
        layout: this rank's part of it, and on rank 0 the whole for the cache."""
        rows = ckpt["model"].get("embedding.word_embeddings.weight")
        if isinstance(rows, torch.Tensor) and rows.shape[0] != self._shape["vocab_size"]:
            raise MegatronModelError(
                f"{path}: its vocabulary has {rows.shape[0]} rows, the model "
                f"{self._shape['vocab_size']}"
            )
        self._install(self.model, ckpt["model"], path)
        if self.model_parallel and self.rank == 0:
            self._full = {k: v for k, v in ckpt["model"].items() if isinstance(v, torch.Tensor)}

    def _load_optim(self, state: dict[str, Any]) -> None:
        """This rank's part of a ``step_N.pt``'s optimizer ``state`` (the whole model's,
        in its order; a tied embedding's last-stage copy starts from the embedding's)."""
        order = self._full_param_names() if self.pp > 1 else self._param_names()
        index = {n: i for i, n in enumerate(order)}
        whole = state["state"]
        by_name = {}
        for n in self._optim_param_names():
            g = self._full_name(n) or EMBEDDING
            if index[g] in whole:
                by_name[n] = {
                    k: shard_tensor(g, v, self.tp_rank, self.tp)
                    if isinstance(v, torch.Tensor) and v.dim()
                    else v
                    for k, v in whole[index[g]].items()
                }
        (group,) = state["param_groups"]
        self._install_optim(by_name, {k: v for k, v in group.items() if k != "params"})

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        s = self._shape
        hf = megatron_to_hf(self._model_state(), s["heads"], s["groups"], s["head_dim"])
        return cast_floats(hf, self.dtype)
