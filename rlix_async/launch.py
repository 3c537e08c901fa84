"""``rlix-async launch PIPELINES.yaml``: everything on one machine, stopped cleanly.

Reads a :class:`~rlix_async.config.LaunchConfig` and starts its placement
(:mod:`rlix_async.placement`, what ``--dry-run`` prints): it writes one
config file per process (``OUT/coordinator.yaml``, ``OUT/<id>/shard-<rank>.yaml``,
``OUT/<id>/pipeline.yaml``: what each process runs with, every default
written out) and starts the coordinator (journal under ``OUT``), one shard
worker per rollout rank of every pipeline, then each pipeline's torchrun job,
each with the ``CUDA_VISIBLE_DEVICES`` of its devices.

It supervises them: a coordinator that dies is restarted on the same journal
(the pipelines and shards reconnect), a pipeline that dies is restarted with
``--resume`` from its newest checkpoint (twice at most, then the run stops),
a shard worker whose engine died is replaced. Ctrl-C, SIGTERM or a failure
stops every process (each leader is asked first and stops its children in
order; then its whole process group is killed, so no orphans: vLLM's engine
cores and torchrun's ranks go with their parents) and removes the pipelines'
shared-memory segments.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import IO

import msgspec

from rlix_async.config import (
    CustomEngineConfig,
    CustomTrainConfig,
    LaunchConfig,
    PipelineConfig,
    dump,
)
from rlix_async.placement import (
    NodePlanError,
    PlacedProcess,
    bind_cores,
    bind_visible_devices,
    engine_environment,
    model_dir,
    node_share,
    place_processes,
    shard_cores,
)
from rlix_async.protocols.topology import SPAN_WORLD
from rlix_async.remote_shards import RemoteShardsWait, remote_shards
from rlix_async.security import ipc_endpoint
from rlix_async.shards.engines import engine_backend
from rlix_async.weights.shm import remove_pipeline_segments

log = logging.getLogger(__name__)

CRASH_WINDOW_S = 600.0  # coordinator crashes older than this are forgiven
SHARDS_READY_TIMEOUT_S = 900.0  # engines load first: the trainers start after them


class LaunchError(ValueError):
    """A config this launcher cannot start (exit code 2, like a config error)."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # the plan's, over the launcher's
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restarted_at: list[float] = field(default_factory=list)  # monotonic, recent ones
    append: bool = False  # a resumed run keeps what the earlier one logged
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        # a fresh start truncates the log; a restart or a resumed run appends to it
        self._log = open(self.log_path, "ab" if self.restarts or self.append else "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**env, **self.env},
            start_new_session=True,  # its own process group: stopped with all its children
        )

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def terminate(self) -> None:
        """SIGTERM to the leader only: it stops its own children in order (a shard shuts
        vLLM down, torchrun its ranks). Signalling the whole group made every vLLM
        process stop at once; on a busy host their teardown outlasted the deadline,
        got SIGKILLed and left vLLM's shared-memory queues behind."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the leader (if not already sent), wait, then SIGKILL whatever is
        left in its group."""
        self.terminate()
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s still running at the stop deadline; killing it", self.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)  # its children too (engine cores, ranks)
            self.popen.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


def _write(path: Path, cfg: msgspec.Struct) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(cfg))
    return path


def resolve_recipes(cfg: LaunchConfig) -> LaunchConfig:
    """Pipelines as every process reads them: the model directory, data files, a
    reward, env or agent file and a custom engine or trainer backend's file as absolute
    paths, the engine's ``max_model_len`` (``rlix-async export`` reads the model directory from
    the pipeline's config, from wherever it runs), and ``max_prompt_tokens`` unset
    filled in with what the engine's context leaves after the response (longer prompts
    would fail in the engine)."""
    engine = cfg.engine
    if isinstance(engine, CustomEngineConfig):  # every shard reads it, from wherever it runs
        engine = msgspec.structs.replace(engine, custom=_absolute_file(engine.custom) or "")
    pipelines = []
    for p in cfg.pipelines:
        if p.model.path is not None:
            model = msgspec.structs.replace(p.model, path=str(Path(p.model.path).resolve()))
            p = msgspec.structs.replace(p, model=model)
        if p.data is not None:
            data = msgspec.structs.replace(
                p.data,
                train=str(Path(p.data.train).resolve()),
                eval=str(Path(p.data.eval).resolve()) if p.data.eval else None,
                max_prompt_tokens=p.data.max_prompt_tokens
                or cfg.engine.max_model_len - p.rollout.max_tokens,
            )
            e = p.env
            env = msgspec.structs.replace(
                e,
                reward=_absolute_file(e.reward),
                env_class=_absolute_file(e.env_class),
                agent=_absolute_file(e.agent),
                agent_api=_absolute_file(e.agent_api),
            )
            p = msgspec.structs.replace(
                p, data=data, env=env, max_model_len=cfg.engine.max_model_len
            )
        if isinstance(p.train, CustomTrainConfig):
            train = msgspec.structs.replace(p.train, custom=_absolute_file(p.train.custom))
            p = msgspec.structs.replace(p, train=train)
        pipelines.append(p)
    return msgspec.structs.replace(cfg, pipelines=pipelines, engine=engine)


def _absolute_file(spec: str | None) -> str | None:
    """``path/file.py:name`` with an absolute path (processes run from other directories)."""
    where, sep, name = (spec or "").rpartition(":")
    if sep and where.endswith(".py"):
        return f"{Path(where).resolve()}:{name}"
    return spec


def check_recipes(cfg: LaunchConfig) -> None:
    """Load every text recipe once (tokenizer, data files, reward), and ask each
    pipeline's trainer backend whether it can train it (a model family it would build
    wrong), before any process starts: a bad file or reward is a LaunchError (exit 2),
    not a torchrun crash loop."""
    from rlix_async.rollout.prompts import RecipeError, load_recipe
    from rlix_async.train.backends import trainer_backend

    for i, p in enumerate(cfg.pipelines):
        try:
            trainer_backend(p.train).check(p)
        except ValueError as exc:  # TrainerBackendError and the backends' own
            raise LaunchError(f"pipelines[{i}] ({p.id}): {exc}") from None
        if p.data is None:
            continue
        try:
            load_recipe(p).close()
        except RecipeError as exc:
            raise LaunchError(f"pipelines[{i}] ({p.id}): {exc}") from None


def precision_warnings(cfg: LaunchConfig) -> list[str]:
    """One line per pipeline whose updates bf16 weights would round away."""
    return [
        f"pipeline {p.id}: train.dtype bfloat16_pure keeps no float32 main weights; at "
        f"lr {p.train.lr:g} most updates are below a bf16 weight's resolution and are lost "
        "(train.dtype bfloat16 keeps them)"
        for p in cfg.pipelines
        if p.train.dtype == "bfloat16_pure"
    ]


@dataclass(frozen=True)
class NodeRole:
    """This machine's part of a multi-node launch (``rlix-async launch --node``)."""

    node: int  # its index: device d lives on node d // gpus_per_node
    coordinator: str  # tcp://HEAD:PORT, bound by node 0, reached by every node
    address: str  # this node's address as the other nodes reach it
    keys: str  # the key directory (tcp is always CURVE)
    job: str  # the same on every node of one run: names its done-markers and segments


class Launcher:
    """Starts the :mod:`placement <rlix_async.placement>` of a one-node config, or
    with ``node`` one node's share of a multi-node one.

    Nodes of one run coordinate only through the coordinator and the shared output
    directory: a node ends when every pipeline of the config has a done-marker under
    ``OUT/nodes/JOB/`` (written by the node that ran its trainer), so a node that only
    hosts shards stops when the pipelines they serve are over.
    """

    def __init__(
        self, cfg: LaunchConfig, *, resume: bool = False, node: NodeRole | None = None
    ) -> None:
        if node is None and cfg.cluster.nodes != 1:
            raise LaunchError(
                f"cluster.nodes is {cfg.cluster.nodes}: run `rlix-async launch CONFIG --node K "
                "--coordinator tcp://HEAD:PORT --address IP --keys DIR --job ID` on each node "
                "(launchers/README.md; --dry-run prints every node's processes), or "
                "launchers/slurm/rlix.sbatch"
            )
        if node is not None:
            _check_node(cfg, node)
        cfg = resolve_recipes(cfg)
        check_recipes(cfg)
        for warning in precision_warnings(cfg):
            log.warning("%s", warning)
        self.cfg = cfg
        self.resume = resume
        self.node = node
        self.out = Path(cfg.out).resolve()
        self.logs = self.out / "logs"
        if node is None:
            self.endpoint = ipc_endpoint(f"coord-{uuid.uuid4().hex[:8]}")
            keys = None
            # Weight segments are named per run directory: two runs of the same pipeline
            # ids on one machine never touch each other's (set here too: we clean them up).
            os.environ.setdefault("RLIX_JOB", hashlib.sha1(str(self.out).encode()).hexdigest()[:8])
        else:
            self.endpoint, keys = node.coordinator, node.keys
            os.environ["RLIX_JOB"] = node.job
        try:
            self.plan = place_processes(cfg, self.out, self.endpoint, keys=keys, resume=resume)
            # shards elsewhere that this node's trainers wait for (remote_shards.py)
            self.remote_shards = remote_shards(self.plan, node.node) if node is not None else {}
            if node is not None:
                self.plan = node_share(self.plan, node.node, node.address)
            bind_visible_devices(self.plan, os.environ)
            engine = engine_backend(cfg.engine)
            binding = engine.binding_variable
            bind_cores(
                self.plan, cfg.cluster.gpus_per_node, shard_cores(binding), os.environ, binding
            )
            engine_environment(self.plan, engine.environment(), os.environ)
        except NodePlanError as exc:
            raise LaunchError(str(exc)) from None
        self.done_dir = self.out / "nodes" / (node.job if node else "local")
        if node is not None and not resume and any(self.done_dir.glob("*.exit")):
            # an earlier run's markers would end this one at once (or fail it)
            raise LaunchError(
                f"{self.done_dir} holds the done-markers of an earlier run with --job "
                f"{node.job}: give this run a new --job, or --resume to continue that one"
            )
        self.coordinator: Proc | None = None
        self.shards: list[Proc] = []
        self.node_caches: list[Proc] = []  # this node's receivers of remote owners' weights
        self.pipelines: dict[str, Proc] = {}
        self.exit_codes: dict[str, int] = {}
        self.env = _child_env()
        self.max_shard_restarts = 3
        self.max_pipeline_restarts = 2  # each resumes from its newest checkpoint
        # A coordinator that keeps dying (e.g. a journal it cannot use) is restarted
        # with growing pauses, then given up on: never a restart loop forever.
        self.max_coordinator_restarts = 8  # within CRASH_WINDOW_S
        self._coordinator_crashes: list[float] = []  # monotonic times, recent ones
        self._coordinator_restart_at: float | None = None
        self._remote_wait: RemoteShardsWait | None = None  # shards elsewhere, not joined yet
        self._trainers_started = False

    def _finished(self) -> bool:
        """Whether the run is over: every pipeline here exited (one node), or every
        pipeline of the config has its done-marker (a node of several). A pipeline that
        failed on any node ends every node's launch with an error."""
        if self.node is None:
            return len(self.exit_codes) == len(self.pipelines)
        done = 0
        for p in self.cfg.pipelines:
            mark = self.done_dir / f"{p.id}.exit"
            with contextlib.suppress(FileNotFoundError, ValueError):
                code = int(mark.read_text())
                if code != 0:
                    raise RuntimeError(f"pipeline {p.id} failed (exit {code}) on another node")
                done += 1
        return done == len(self.cfg.pipelines)

    def _spans_nodes(self, pid: str) -> bool:
        """Whether ``pid``'s trainer runs on several nodes (this node has one part)."""
        return any(
            x.role == "trainer" and x.pipeline == pid and SPAN_WORLD in x.env for x in self.plan
        )

    def _first_part(self, pid: str) -> bool:
        """Whether this node runs ``pid``'s rank 0 (its trainer's only node, or the first
        of those it spans)."""
        return any(
            x.role == "trainer" and x.pipeline == pid and x.first_rank == 0 for x in self.plan
        )

    def _mark_done(self, pid: str, code: int) -> None:
        """Tell every node of the run that ``pid`` is over (written atomically)."""
        if self.node is None:
            return
        self.done_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.done_dir / f".{pid}.exit.{os.getpid()}"
        tmp.write_text(f"{code}\n")
        tmp.replace(self.done_dir / f"{pid}.exit")

    def _proc(self, planned: PlacedProcess) -> Proc:
        if planned.config is not None and planned.config_path is not None:
            _write(planned.config_path, planned.config)
        assert planned.log_path is not None
        env = dict(planned.env)
        return Proc(planned.name, planned.argv, planned.log_path, env=env, append=self.resume)

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        if self.node is None:  # several nodes share model.path (checked)
            for p in self.cfg.pipelines:
                self._write_model(p)
        for planned in self.plan:
            if planned.role == "coordinator":
                self.coordinator = self._proc(planned)
                self.coordinator.start(self.env)
            elif planned.role == "shard":
                proc = self._proc(planned)
                proc.start(self.env)
                self.shards.append(proc)
            elif planned.role == "node_cache":
                proc = self._proc(planned)
                proc.start(self.env)
                self.node_caches.append(proc)
        self._wait_shards_ready()
        drivers = [p.pipeline for p in self.plan if p.role == "trainer" and p.pipeline]
        if self.node is not None and self.remote_shards and drivers:
            # the trainers start from step() once these joined, supervision going on
            self._remote_wait = RemoteShardsWait(
                self.remote_shards, self.endpoint, self.node.keys, drivers[0],
                SHARDS_READY_TIMEOUT_S,
            )  # fmt: skip
        self._start_trainers_when_ready()

    def _start_trainers_when_ready(self) -> None:
        if self._trainers_started:
            return
        if self._remote_wait is not None and not self._remote_wait.ready():
            return
        self._trainers_started = True
        for planned in self.plan:
            if planned.role == "trainer":
                assert planned.pipeline is not None
                self.pipelines[planned.pipeline] = proc = self._proc(planned)
                proc.start(self.env)

    def _write_model(self, p: PipelineConfig) -> None:
        """A pipeline without model.path gets a tiny random Llama, written once."""
        path = model_dir(p, self.out)
        if not p.model.path and not (path / "config.json").exists():
            from rlix_async.models.tiny import save_tiny_llama

            save_tiny_llama(path, seed=p.seed, **p.model.tiny)

    def _wait_shards_ready(self, timeout_s: float = SHARDS_READY_TIMEOUT_S) -> None:
        """Pipelines start once every shard worker is connected (engines load first)."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.shards)
        while pending:
            for proc in list(pending):
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited during startup; see {proc.log_path}")
                if b"READY " in proc.log_path.read_bytes():
                    pending.remove(proc)
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise RuntimeError(f"shard workers not ready after {timeout_s:.0f}s: {names}")
            time.sleep(0.5)

    def _pipeline_proc(self, p: PipelineConfig, *, resume: bool) -> Proc:
        """The pipeline's trainer (this node's part of it) again, as the plan has it:
        its config, devices and environment, ``--resume`` as asked."""
        planned = next(x for x in self.plan if x.role == "trainer" and x.pipeline == p.id)
        argv = [a for a in planned.argv if a != "--resume"] + (["--resume"] if resume else [])
        return self._proc(replace(planned, argv=argv))

    def restart_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.stop()
        self.coordinator.restarts += 1
        self.coordinator.start(self.env)

    def coordinator_backoff_s(self) -> float:
        """Pause before the next restart: none after one recent crash, then doubling
        from 0.5 s up to 30 s, so a crash loop neither spins nor gives up at once."""
        n = len(self._coordinator_crashes)
        return 0.0 if n <= 1 else min(30.0, 0.5 * 2 ** (n - 2))

    def restart_pipeline(self, pid: str) -> None:
        """Kill a pipeline and start it again from its newest checkpoint."""
        old = self.pipelines[pid]
        old.stop()
        spec = next(p for p in self.cfg.pipelines if p.id == pid)
        new = self._pipeline_proc(spec, resume=True)
        new.restarts = old.restarts + 1
        self.pipelines[pid] = new
        new.start(self.env)

    def step(self) -> bool:
        """One supervision pass; False once every pipeline has finished."""
        self._start_trainers_when_ready()
        code = self.coordinator.poll() if self.coordinator is not None else None
        if code is not None:
            assert self.coordinator is not None
            now = time.monotonic()
            if self._coordinator_restart_at is None:
                self._coordinator_crashes = [
                    t for t in self._coordinator_crashes if now - t < CRASH_WINDOW_S
                ] + [now]
                if len(self._coordinator_crashes) > self.max_coordinator_restarts:
                    raise RuntimeError(
                        f"the coordinator keeps failing (exit {code}, "
                        f"{len(self._coordinator_crashes)} times in {CRASH_WINDOW_S:.0f} s); "
                        f"see {self.coordinator.log_path}"
                    )
                self._coordinator_restart_at = now + self.coordinator_backoff_s()
                log.warning(
                    "coordinator exited (%s); restarting it on its journal in %.1f s",
                    code,
                    self._coordinator_restart_at - now,
                )
            if now >= self._coordinator_restart_at:
                self._coordinator_restart_at = None
                self.restart_coordinator()
        for shard in [*self.node_caches, *self.shards]:
            code = shard.poll()
            if code is not None and not self._finished():
                # within CRASH_WINDOW_S: a long run may replace a worker now and then
                # (a broken shard is told to exit for this), but not keep doing so
                now = time.monotonic()
                shard.restarted_at = [t for t in shard.restarted_at if now - t < CRASH_WINDOW_S]
                if len(shard.restarted_at) >= self.max_shard_restarts:
                    raise RuntimeError(f"{shard.name} keeps failing; see {shard.log_path}")
                shard.restarted_at.append(now)
                log.warning("%s exited (%s); starting a new one", shard.name, code)
                shard.stop()
                shard.restarts += 1
                shard.start(self.env)
        for pid, proc in list(self.pipelines.items()):
            code = proc.poll()
            if code is None or pid in self.exit_codes:
                continue
            if code == 0:
                self.exit_codes[pid] = code
                if self._first_part(pid):  # rank 0 is done after every other rank
                    self._mark_done(pid, code)
            elif proc.restarts < self.max_pipeline_restarts and not self._spans_nodes(pid):
                log.warning(
                    "pipeline %s died (exit %s); resuming it from its checkpoint", pid, code
                )
                self.restart_pipeline(pid)
            else:
                self.exit_codes[pid] = code
                self._mark_done(pid, code)
                whole = (
                    " (a trainer across nodes is not restarted a node at a time: run every "
                    "node's launch again with --resume)"
                    if self._spans_nodes(pid)
                    else ""
                )
                raise RuntimeError(
                    f"pipeline {pid} failed (exit {code}); see {proc.log_path}{whole}"
                )
        return not self._finished()

    def run(self, poll_s: float = 0.5, on_poll: Callable[[Launcher], None] | None = None) -> None:
        """Start and supervise until every pipeline finished; always stops everything.

        SIGTERM is turned into KeyboardInterrupt so the cleanup runs for it too.
        """

        def _terminated(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            self._run(poll_s, on_poll)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self, poll_s: float, on_poll: Callable[[Launcher], None] | None) -> None:
        try:
            self.start()
            while self.step():
                if on_poll is not None:
                    on_poll(self)
                time.sleep(poll_s)
        finally:
            self.stop()

    def stop(self) -> None:
        """Pipelines first (they unregister), then shards and the coordinator, in parallel."""
        for proc in self.pipelines.values():
            proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.pipelines.values():
            proc.stop(max(0.1, deadline - time.monotonic()))
        rest = [
            *self.shards,
            *self.node_caches,  # after the shards (they read its slots), with them
            *([self.coordinator] if self.coordinator else []),
        ]
        for proc in rest:
            proc.terminate()
        deadline = time.monotonic() + 15
        for proc in rest:
            proc.stop(max(0.1, deadline - time.monotonic()))
        for p in self.cfg.pipelines:
            remove_pipeline_segments(p.id)


def _check_node(cfg: LaunchConfig, node: NodeRole) -> None:
    """What a node of a multi-node launch needs, checked before anything starts."""
    from rlix_async.security import SecurityError, ServerKeys

    if not 0 <= node.node < cfg.cluster.nodes:
        raise LaunchError(f"--node {node.node}: cluster.nodes is {cfg.cluster.nodes}")
    if not node.coordinator.startswith("tcp://"):
        raise LaunchError(f"--coordinator {node.coordinator}: nodes meet on tcp://HEAD:PORT")
    if not node.job or not node.job.replace("-", "").replace("_", "").isalnum():
        raise LaunchError(f"--job {node.job!r}: letters, digits, - and _ (the same on every node)")
    gpn = cfg.cluster.gpus_per_node
    for p in cfg.pipelines:
        nodes = {d // gpn for d in p.clusters["actor_train"].devices}
        key = Path(node.keys) / f"driver-{p.id}.key_secret"
        if len(nodes) > 1 and node.node in nodes and not key.exists():
            raise LaunchError(
                f"{key}: missing; pipeline {p.id}'s trainer spans nodes {sorted(nodes)}, and "
                "each of them derives its ranks' store secret from the pipeline's own "
                f"driver key (rlix-async keygen KEYS --client driver-{p.id} --role driver "
                f"--pipeline {p.id}; copy it to those nodes)"
            )
    if cfg.node_addresses is not None and cfg.node_addresses[node.node] != node.address:
        raise LaunchError(
            f"--address {node.address}: node_addresses[{node.node}] is "
            f"{cfg.node_addresses[node.node]} (the other nodes reach this one there)"
        )
    missing = [p.id for p in cfg.pipelines if not p.model.path]
    if missing:
        raise LaunchError(
            f"pipelines {missing}: set model.path (a directory every node reads): the "
            "random test model is written by a one-node launch only"
        )
    try:  # the coordinator's node needs its pair; every node a private key directory
        if node.node == 0:
            ServerKeys.load(node.keys)
        elif not Path(node.keys, "server.key").is_file():
            raise SecurityError(f"{node.keys}/server.key: missing (copy it from the keygen)")
    except SecurityError as exc:
        raise LaunchError(str(exc)) from None


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # many small processes share few cores
    env["PYTHONUNBUFFERED"] = "1"
    return env
