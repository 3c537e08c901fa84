"""The Megatron-core trainer backend: a Llama- or Qwen3-MoE-shaped ``GPTModel``, exported
under HF names.

The same time-sharing cycle as the torch backend (protocols/trainer.py), with
Megatron's parallel state built and destroyed with each step's group. HF
Llama-family and Qwen3-MoE weights come in through ``hf_to_megatron`` and leave
through ``megatron_to_hf`` (vLLM's loader takes those names); other families are
refused by :func:`model_shape`, at launch (``megatron_backend.MegatronBackend.check``), as is an MoE
model at a layout not built for it (``check_moe_layout``).

Composed, not derived: the step is train/policy_update.py's (every backend's), run
over :class:`~rlix_async.train.megatron_parallel.MegatronParallel` (tensor x pipeline
x data parallel, the distributed optimizer's shares); the optimizer and precision are
``precision.build_optimizer``'s, the offload ``host_buffers.DeviceOffload``. What is
Megatron's own lives here: building and loading the GPTModel at this rank's stage
and slices, gathering the whole model onto rank 0 after every step for the weight
cache (``stage_transfer.gather_model``), and sharded checkpoints, each rank writing
its own part (``train/sharded_checkpoint.py``), resumed at any layout (``step_N.pt``
files from one rank load too). On CPU it needs ``megatron_cpu_compat``; its CUDA RNG
tracker is seeded with the parallel state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import MegatronTrainConfig, ModelConfig, resolve_dtype
from rlix_async.config.training import replays_routes
from rlix_async.models.hf import load_hf_model
from rlix_async.protocols.batch import Group
from rlix_async.train import sharded_checkpoint
from rlix_async.train.checkpoints import (
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from rlix_async.train.devices import RankPlace
from rlix_async.train.host_buffers import DeviceOffload, state_tensors
from rlix_async.train.megatron_hf import (
    MegatronModelError,
    hf_to_megatron,
    megatron_to_hf,
    model_shape,
    read_hf_part,
    stage_reads,
)
from rlix_async.train.megatron_model import gpt_model, tiny_shape
from rlix_async.train.megatron_moe import (
    ExpertLoad,
    check_moe_layout,
    expert_global_name,
    expert_reads,
    is_expert,
    to_expert_rank,
)
from rlix_async.train.megatron_parallel import MegatronLayout, MegatronParallel
from rlix_async.train.pipeline_parallel import (
    EMBEDDING,
    check_layers,
    full_param_order,
    global_name,
    to_stage,
)
from rlix_async.train.policy_update import PolicyUpdate
from rlix_async.train.precision import (
    DTYPES,
    MainParamsAdamW,
    build_optimizer,
    cast_floats,
    drop_main_params,
)
from rlix_async.train.routing_replay import RouteReplay
from rlix_async.train.sharded_checkpoint import ShardedCheckpoint, sharded_path
from rlix_async.train.stage_transfer import gather_model
from rlix_async.train.tensor_parallel import check_shape, pad_vocab_rows, shard, shard_tensor


class MegatronTrainer:
    def __init__(
        self,
        cfg: MegatronTrainConfig | None = None,
        model: ModelConfig | None = None,
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        store: dist.Store | None = None,
        checkpoint_to: Callable[[int], Path | None] | None = None,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        start_offloaded: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        total_steps: int | None = None,
    ) -> None:
        """``tp`` x ``pp`` ranks per replica, ``ep`` replicas sharing out each one's
        experts (``protocols.topology.trainer_place``); with more than one rank every
        rank constructs its trainer at the same time, meeting on ``store``.
        ``checkpoint_to(step)``: the path rank 0 will ``save`` the step just trained
        to, None when it is not checkpointed (under model parallel every rank writes
        its part of it while the step's group is up)."""
        if tp * pp * ep > 1 and (store is None or world % (tp * pp * ep)):
            raise ValueError(
                f"tensor x pipeline x expert parallel {tp} x {pp} x {ep} needs a store and "
                f"a multiple of {tp * pp * ep} ranks"
            )
        self.cfg = cfg or MegatronTrainConfig()
        self.model_cfg = model or ModelConfig()
        self.seed = seed
        self.place = RankPlace.of(rank, world)
        self.device = self.place.device
        self.dtype = DTYPES[resolve_dtype(self.cfg.dtype, self.device.type == "cuda")]
        self.layout = MegatronLayout(rank, world, tp, pp, self.device, ep)
        self._store = store
        self.checkpoint_to = checkpoint_to or (lambda step: None)
        self._full: dict[str, torch.Tensor] | None = None  # rank 0, model parallel: the whole model
        self._parts_step = -1  # the last step whose parts every rank wrote (sharded checkpoint)
        self.reference: torch.nn.Module | None = None
        try:
            self.model = self._build_model()
            self.parallel = MegatronParallel(
                self.layout,
                vocab=self._shape["vocab_size"],
                tied=self._shape["tied"],
                temperature=temperature,
                top_p=top_p,
                max_grad_norm=self.cfg.max_grad_norm,
            )
            self.parallel.model = self.model
            self._expert_load = self._moe_hooks()
            if not start_offloaded:
                self.model = self.model.to(self.device)
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            mine = self.parallel.share(trainable, self.cfg.distributed_optimizer)
            self.optim = build_optimizer(mine, self.cfg)
            if self.cfg.loss.kl_coef > 0:  # the starting weights, frozen
                self.reference = self._frozen_copy()
            if self.layout.model_parallel:
                self._full = self._gather_model()
        finally:
            if self.layout.model_parallel:  # no DDP yet: the groups alone
                self.layout.destroy()
        self.update = PolicyUpdate(
            self.cfg, self.parallel, self.device, total_steps=total_steps or 0
        )
        if self.parallel.replay is not None:  # the batch carries the engine's routes
            moe = self._shape["moe"]
            self.update.route_shape = (sum(moe["layers"]), moe["topk"])
        self.step = 0
        self.step_times: dict[str, float] = {}
        self._memory = DeviceOffload(self.device)
        if start_offloaded and self.device.type == "cuda":  # built in host memory
            self._memory.moved = list(state_tensors(self.model, self.optim, self.reference))

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are sharded (every rank holds a part no other has)."""
        return self.layout.model_parallel or self.parallel.owners is not None

    @property
    def offloaded(self) -> bool:
        return bool(self._memory.moved)

    def _models(self) -> list[torch.nn.Module]:
        """The GPTModels built so far (the policy, the KL reference)."""
        models = (getattr(self, "model", None), self.reference)
        return [m for m in models if m is not None]

    def parallel_state(self, store: dist.Store | None, backend: str | None = None) -> None:
        """Megatron's parallel state over a fresh group on ``store`` (None: a private
        one-rank group, as a step running alone and the tests use)."""
        self.layout.init(store, self._models(), self.seed, backend)

    def _build_model(self) -> torch.nn.Module:
        from rlix_async.train import megatron_cpu_compat

        megatron_cpu_compat.apply()  # before Megatron is imported or used (CPU only)
        path = self.model_cfg.path
        self._shape = model_shape(path) if path else tiny_shape(self.model_cfg)
        # whether the policy replays the engine's routing (config.json read once)
        self._replays = self._shape.get("moe") is not None and replays_routes(
            self.cfg, self.model_cfg
        )
        check_shape(self._shape["heads"], self._shape["groups"], self.layout.tp)
        check_layers(self._shape["layers"], self.layout.pp)
        lay = self.layout
        check_moe_layout(self._shape.get("moe"), lay.tp, lay.pp, lay.ep)
        model = self._gpt_model()
        if path:
            self._load_hf(model, path)
        return model

    def _moe_hooks(self) -> ExpertLoad | None:
        """An MoE policy's router hooks: each expert's load counted, and the engine's
        routes replayed when it does (``train/routing_replay.py``; the routes' columns
        are the MoE layers in order)."""
        moe = self._shape.get("moe")
        if moe is None:
            return None

        def layer(router: str) -> int:  # the full model's layer of this rank's router
            full = self._full_name(f"{router}.weight") or ""
            return int(full.split(".")[2])  # decoder.layers.N.mlp.router.weight

        if self._replays:
            moe_layers = [i for i, is_moe in enumerate(moe["layers"]) if is_moe]
            recompute = self.cfg.recompute == "full"
            self.parallel.replay = RouteReplay(self.model, layer, moe_layers.index, recompute)
        return ExpertLoad(self.model, layer, self._shape["layers"], moe["experts"])

    def _gpt_model(self) -> torch.nn.Module:
        """A GPTModel (this rank's stage and tensor-parallel part) of ``self._shape``,
        seeded initial weights, in the trainer's dtype, in host memory."""
        # building the model needs Megatron's parallel state: a private one-rank group,
        # or under model parallel the real one, up until the constructor's end
        # (gloo: the model is built, loaded and gathered in host memory)
        lay = self.layout
        self.parallel_state(self._store if lay.model_parallel else None, "gloo")
        torch.manual_seed(self.seed)
        model = gpt_model(
            self._shape, self.dtype, self.cfg.recompute, lay.tp, lay.pp, lay.stage, lay.ep,
            routing_replay=self._replays,
        )  # fmt: skip
        if not lay.model_parallel:
            lay.destroy()  # the time-sharing cycle creates groups per step
        return model

    @property
    def _experts_per_rank(self) -> int:
        moe = self._shape.get("moe")
        return moe["experts"] // self.layout.ep if moe else 0

    def _full_name(self, local: str) -> str | None:
        """The full model's name of this stage's (and expert-parallel rank's) ``local``
        (None: a tied embedding's last-stage copy)."""
        s, lay = self._shape, self.layout
        name = global_name(local, lay.stage, lay.pp, s["layers"], s["tied"])
        return name and expert_global_name(name, lay.ep_rank, self._experts_per_rank)

    def _to_stage(self, full: Mapping[str, object]) -> dict[str, object]:
        """This rank's part of ``full`` (the whole model's names): its stage's layers,
        its own experts, under its local names."""
        s, lay = self._shape, self.layout
        staged = to_stage(full, lay.stage, lay.pp, s["layers"], s["tied"])
        if lay.ep == 1:
            return staged
        return to_expert_rank(staged, lay.ep_rank, lay.ep, s["moe"]["experts"])

    def _load_hf(self, model: torch.nn.Module, path: str) -> None:
        """The directory's weights into ``model``, every parameter accounted for. Under
        model parallel each rank reads only its own stage's tensors and its own slices
        of them from a safetensors directory (its memory holds its part of the model,
        not all of it)."""
        s, lay = self._shape, self.layout
        stage = stage_reads(lay.stage, lay.pp, s["layers"], s["tied"])
        experts = expert_reads(lay.ep_rank, lay.ep, s["moe"]["experts"]) if lay.ep > 1 else None

        def wanted(name: str) -> bool:
            return stage(name) and (experts is None or experts(name))

        if (
            lay.model_parallel
            and (part := read_hf_part(path, s, lay.tp_rank, lay.tp, wanted)) is not None
        ):
            local = hf_to_megatron(
                part, s["heads"] // lay.tp, s["groups"] // lay.tp, s["head_dim"], tied=s["tied"]
            )
            mine = self._to_stage(local)
            pad_vocab_rows(mine, s["vocab_size"], lay.tp)  # type: ignore[arg-type]
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
        lay = self.layout
        mine = shard(self._to_stage(state), lay.tp_rank, lay.tp) if whole else dict(state)
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

    # --- the time-sharing cycle --------------------------------------------------------

    def init_group(self, store: dist.Store | None) -> None:
        if self._memory.moved:
            raise RuntimeError("init_group() on an offloaded trainer: call reload() first")
        self.parallel_state(store if self.place.world > 1 else None)
        if self.layout.dp_world > 1 and not self.parallel.manual_reduce:
            self.parallel.data.wrap(self.model)

    def destroy_group(self) -> None:
        self.parallel.data.unwrap()
        self.layout.destroy()

    def offload(self) -> None:
        """Free the device for rollout (page-locked host buffers); nothing on CPU."""
        if self.device.type != "cuda" or self._memory.moved:
            return
        if self.parallel.data.ddp is not None:
            raise RuntimeError("offload() while the process group is up: destroy_group() first")
        self._memory.offload(self.model, self.optim, self.reference)

    def reload(self) -> None:
        if self._memory.moved:
            self._memory.reload(self.model, self.optim, self.reference)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        if self._memory.moved:
            raise RuntimeError("train_step() on an offloaded trainer: call reload() first")
        if not dist.is_initialized():  # running alone: a private one-rank group
            if self.layout.model_parallel:
                raise RuntimeError("a model-parallel step needs init_group(store) first")
            self.parallel_state(None)
            try:
                return self._step(groups)
            finally:
                self.destroy_group()
        return self._step(groups)

    def _step(self, groups: list[Group]) -> dict[str, float]:
        stats = self.update.run(self.model, self.optim, self.reference, groups, self.step)
        self.step += 1
        self.step_times = dict(self.update.step_times)
        if self.layout.pp > 1:
            stats = self.parallel.from_last_stage(stats)
        if self._expert_load is not None:
            stats |= self._expert_load.stats(self.device)
        if self.parallel.replay is not None:
            stats |= self.parallel.replay.stats(self.device)
            # the share of responses the shards recorded routes for (0: none replayed,
            # e.g. a CUDA shard with CUDA graphs, env episodes: the trainer routed alone)
            recorded = [bool(r) for g in groups for r in (g.routes or [b""] * len(g.responses))]
            stats["routing_replay_rows"] = sum(recorded) / max(len(recorded), 1)
        if self.layout.model_parallel:  # while the group is up: the weight cache needs it whole
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
        lay = self.layout
        # under expert parallel the next ep - 1 replicas hold the other experts: each
        # writes those (and their optimizer state), nothing else
        experts_only = 0 < lay.dp_rank < lay.ep

        def name(local: str) -> str | None:
            return None if experts_only and not is_expert(local) else self._full_name(local)

        def part() -> dict[str, torch.Tensor]:
            return sharded_checkpoint.rank_part(
                self.model.state_dict() if lay.dp_rank == 0 or experts_only else {},
                self.optim.state_dict()["state"],
                self._optim_param_names(),
                name,
            )

        mine = lay.dp_rank == 0 or experts_only or self.parallel.owners is not None
        where = (lay.stage, lay.tp_rank, lay.dp_rank)
        sharded_checkpoint.write_parts(path, lay.rank, part if mine else None, where, self.device)
        self._parts_step = self.step

    def _gather_model(self) -> dict[str, torch.Tensor] | None:
        s, lay = self._shape, self.layout
        return gather_model(
            self.model.state_dict(),
            tp=(lay.tp_rank, lay.tp),
            stage=(lay.stage, lay.pp),
            replica=(lay.dp_rank, lay.ep),
            shape=(s["layers"], s["tied"], s["vocab_size"]),
            device=self.device,
            rank_of=lay.rank_of,
            experts_per_rank=self._experts_per_rank,
        )

    # --- checkpoints and the weight cache --------------------------------------------------

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
        self.optim.load_state_dict(
            {"state": state, "param_groups": [{**group, "params": list(range(len(names)))}]}
        )

    def _resume_at(self, step: int, rng: dict[str, Any]) -> None:
        """After a checkpoint's model and optimizer state are in: its step and RNG (main
        weights it holds dropped when this run trains without them)."""
        if not isinstance(self.optim, MainParamsAdamW):
            drop_main_params(self.optim)
        self.step = int(step)
        set_rng_state(rng, self.device)

    def _model_state(self) -> dict[str, Any]:
        """The whole (tp=1/pp=1) model in Megatron's names: this rank's own without
        model parallel, else the one gathered onto rank 0 at every step (checkpoints and
        the cache read it)."""
        if not self.layout.model_parallel:
            return self.model.state_dict()
        if self._full is None:
            raise RuntimeError("only rank 0 holds the whole model (gathered at every step)")
        return self._full

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        """A ``step_N.pt`` file of the whole model; under model parallel (or a sharded
        optimizer) the sharded checkpoint whose parts the ranks wrote as the step
        trained (``checkpoint_to`` named it), completed with the step, the RNG state and
        ``extra`` and promoted; returns what was written."""
        if not self.sharded:
            state = {
                "model": self._model_state(),
                "optim": self.optim.state_dict(),
                # the optimizer's order by name: a rank of another layout (its experts,
                # its stage) finds each parameter's state by it
                "optim_names": self._param_names(),
                "step": self.step,
                "rng": rng_state(self.device),
            }
            return write_checkpoint(path, {**state, **extra})
        if self._parts_step != self.step:
            raise RuntimeError(
                f"the parts of step {self.step}'s checkpoint were not written: "
                "checkpoint_to must name it when the step trains"
            )
        s, lay = self._shape, self.layout
        (group,) = self.optim.state_dict()["param_groups"]  # one: AdamW over every weight
        meta = {
            "tp": lay.tp,
            "pp": lay.pp,
            "layers": s["layers"],
            "tied": s["tied"],
            "vocab_size": s["vocab_size"],
            # the replicas that wrote parts: optimizer shards, or the other experts' holders
            "dp": lay.dp_world if self.parallel.owners is not None else lay.ep,
            "ep": lay.ep,
            "step": self.step,
            "rng": rng_state(self.device),
            "param_group": {k: v for k, v in group.items() if k != "params"},
            **extra,
        }
        return sharded_checkpoint.promote(sharded_path(path), meta)

    def load(self, path: Path) -> dict[str, Any]:
        if not path.is_dir():
            return self._load_file(path)
        ckpt = ShardedCheckpoint(path)
        s, lay = self._shape, self.layout
        if ckpt.vocab != s["vocab_size"] or int(ckpt.meta["layers"]) != s["layers"]:
            raise MegatronModelError(
                f"{path}: its model has {ckpt.meta['layers']} layers and a vocabulary of "
                f"{ckpt.vocab}, this one {s['layers']} and {s['vocab_size']}"
            )
        # this stage's tensors under their local names, from the full model's names
        wanted = self._to_stage({name: name for name in ckpt.model_names()})
        local = {k: ckpt.part(str(name), lay.tp_rank, lay.tp) for k, name in wanted.items()}
        self._install(self.model, local, path, whole=False)
        # only what this rank's optimizer holds; a tied embedding's last-stage copy
        # starts from the embedding's state
        names = {n: self._full_name(n) or EMBEDDING for n in self._optim_param_names()}
        self._install_optim(ckpt.rank_optim(names, lay.tp_rank, lay.tp), ckpt.meta["param_group"])
        self._resume_at(ckpt.meta["step"], ckpt.meta["rng"])
        if lay.model_parallel and lay.rank == 0:
            self._full = ckpt.full_model()
        return ckpt.meta

    def _load_file(self, path: Path) -> dict[str, Any]:
        """A ``step_N.pt`` checkpoint holds the whole (tp=1/pp=1) model whatever its
        layout: this rank's part of it and of its optimizer state (a tied embedding's
        last-stage copy starts from the embedding's), and on rank 0 the whole model for
        the cache."""
        ckpt = read_checkpoint(path)
        rows = ckpt["model"].get("embedding.word_embeddings.weight")
        if isinstance(rows, torch.Tensor) and rows.shape[0] != self._shape["vocab_size"]:
            raise MegatronModelError(
                f"{path}: its vocabulary has {rows.shape[0]} rows, the model "
                f"{self._shape['vocab_size']}"
            )
        lay = self.layout
        self._install(self.model, ckpt["model"], path)
        if lay.model_parallel and lay.rank == 0:
            self._full = {k: v for k, v in ckpt["model"].items() if isinstance(v, torch.Tensor)}
        order = ckpt.get("optim_names")
        if order is None and (lay.ep > 1 or (lay.pp > 1 and self._shape.get("moe"))):
            # older files: the order is rebuilt from this rank's names, which holds only
            # for dense layers (an expert rank's local experts are not the file's)
            raise MegatronModelError(
                f"{path}: written before checkpoints named the optimizer's parameters; "
                "resume this mixture-of-experts model at pp 1 and ep 1 once first"
            )
        order = order or (self._full_param_names() if lay.pp > 1 else self._param_names())
        index = {n: i for i, n in enumerate(order)}
        whole = ckpt["optim"]["state"]
        by_name = {}
        for n in self._optim_param_names():
            g = self._full_name(n) or EMBEDDING
            if index[g] in whole:
                by_name[n] = {
                    k: shard_tensor(g, v, lay.tp_rank, lay.tp)
                    if isinstance(v, torch.Tensor) and v.dim()
                    else v
                    for k, v in whole[index[g]].items()
                }
        (group,) = ckpt["optim"]["param_groups"]
        self._install_optim(by_name, {k: v for k, v in group.items() if k != "params"})
        self._resume_at(ckpt["step"], ckpt["rng"])
        return ckpt

    def _full_param_names(self) -> list[str]:
        """The whole (tp=1/pp=1) model's, in its optimizer's order."""
        return full_param_order(self._param_names(), self._shape["layers"], self._shape["tied"])

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        s = self._shape
        hf = megatron_to_hf(self._model_state(), s["heads"], s["groups"], s["head_dim"])
        return cast_floats(hf, self.dtype)
