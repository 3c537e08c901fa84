"""``rlix-async launch PIPELINES.yaml``: everything on one machine, stopped cleanly.

Starts the coordinator (journal under ``out``), one shard worker process per
rollout rank of every pipeline (vLLM), then each pipeline's torchrun job. It
supervises them: a coordinator that dies is restarted on the same journal (the
pipelines and shards reconnect), a pipeline that dies is restarted with
``--resume`` from its newest checkpoint (twice at most, then the run stops),
a shard worker whose engine died is replaced. Ctrl-C,
SIGTERM or a failure stops every process (each leader is asked first and
stops its children in order; then its whole process group is killed, so no
orphans: vLLM's engine cores and torchrun's ranks go with their parents) and
removes the pipelines' shared-memory segments.

Config (YAML or JSON)::

    out: rlix-out
    cluster: {nodes: 1, gpus_per_node: 4}
    shard: {engine: vllm, kv_cache_mb: 64, max_model_len: 256}
    pipelines:
      - id: math-a
        nproc: 1                       # torchrun ranks (trainer DDP world)
        steps: 10
        task: {name: target_tokens, lo: 0, hi: 32}
        clusters:
          actor_train: {tp: 1, devices: [0]}
          actor_infer: {tp: 1, devices: [0, 1, 2]}

Every other pipeline key is a ``PipelineConfig`` field (rlix_async/grpo/pipeline.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from rlix_async.grpo.pipeline import PipelineConfig
from rlix_async.security import ipc_endpoint
from rlix_async.weights.cache import remove_pipeline_segments

log = logging.getLogger(__name__)


class ShardIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine: str = "vllm"  # vllm | scripted (scripted is a test double)
    kv_cache_mb: int = 64
    max_model_len: int = 256
    dtype: str = "float32"


class ClusterShapeIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nodes: int = 1
    gpus_per_node: int = 4


class PipelineIn(PipelineConfig, forbid_unknown_fields=True):
    nproc: int = 1


class LaunchConfig(msgspec.Struct, forbid_unknown_fields=True):
    pipelines: list[PipelineIn]
    out: str = "rlix-out"
    cluster: ClusterShapeIn = ClusterShapeIn()
    shard: ShardIn = ShardIn()
    lease_timeout_s: float = 60.0


def load_launch_config(path: str | Path) -> LaunchConfig:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
        return msgspec.convert(raw, LaunchConfig)
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"{path}: cannot read launch config: {exc}") from None
    except msgspec.ValidationError as exc:
        raise SystemExit(f"{path}: invalid launch config: {exc}") from None


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        # a fresh start truncates the log; a restart appends to it
        self._log = open(self.log_path, "ab" if self.restarts else "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
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


class Launcher:
    def __init__(self, cfg: LaunchConfig, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.resume = resume
        self.out = Path(cfg.out).resolve()
        self.logs = self.out / "logs"
        self.endpoint = ipc_endpoint(f"coord-{uuid.uuid4().hex[:8]}")
        self.coordinator: Proc | None = None
        self.shards: list[Proc] = []
        self.pipelines: dict[str, Proc] = {}
        self.exit_codes: dict[str, int] = {}
        self.env = _child_env()
        self.max_shard_restarts = 3
        self.max_pipeline_restarts = 2  # each resumes from its newest checkpoint

    def _py(self, *args: str) -> list[str]:
        return [sys.executable, "-m", *args]

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        c = self.cfg.cluster
        self.coordinator = Proc(
            "coordinator",
            self._py(
                "rlix_async.cli",
                "coordinator",
                "--endpoint",
                self.endpoint,
                "--nodes",
                str(c.nodes),
                "--gpus-per-node",
                str(c.gpus_per_node),
                "--journal",
                str(self.out / "journal.jsonl"),
                "--lease-timeout",
                str(self.cfg.lease_timeout_s),
            ),
            self.logs / "coordinator.log",
        )
        self.coordinator.start(self.env)
        for p in self.cfg.pipelines:
            self._start_shards(p)
        self._wait_shards_ready()
        for p in self.cfg.pipelines:
            self.pipelines[p.id] = self._pipeline_proc(p, resume=self.resume)
            self.pipelines[p.id].start(self.env)

    def _start_shards(self, p: PipelineIn) -> None:
        from rlix_async.models.tiny import save_tiny_llama

        model_dir = Path(p.model_path) if p.model_path else self.out / p.id / "model"
        if not p.model_path and not (model_dir / "config.json").exists():
            save_tiny_llama(model_dir, seed=p.seed, **p.model)
        infer = p.clusters.get("actor_infer")
        if infer is None:
            return
        s = self.cfg.shard
        for rank in range(len(infer.devices) // infer.tp):
            argv = self._py(
                "rlix_async.cli",
                "shard",
                "--engine",
                s.engine,
                "--pipeline",
                p.id,
                "--rank",
                str(rank),
                "--coordinator",
                self.endpoint,
                "--model",
                str(model_dir),
                "--dtype",
                s.dtype,
                "--max-model-len",
                str(s.max_model_len),
                "--kv-cache-mb",
                str(s.kv_cache_mb),
            )
            proc = Proc(f"shard {p.id}/{rank}", argv, self.logs / f"shard-{p.id}-{rank}.log")
            proc.start(self.env)
            self.shards.append(proc)

    def _wait_shards_ready(self, timeout_s: float = 900.0) -> None:
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

    def _pipeline_proc(self, p: PipelineIn, *, resume: bool) -> Proc:
        conf = msgspec.to_builtins(p)
        conf.pop("nproc")
        conf["out"] = str(self.out)
        conf["coordinator"] = self.endpoint
        path = self.out / p.id / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(conf, indent=2))
        argv = self._py(
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={p.nproc}",
            "-m",
            "rlix_async.grpo.pipeline",
            "--config",
            str(path),
        )
        if resume:
            argv.append("--resume")
        return Proc(f"pipeline {p.id}", argv, self.logs / f"pipeline-{p.id}.log")

    def restart_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.stop()
        self.coordinator.restarts += 1
        self.coordinator.start(self.env)

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
        assert self.coordinator is not None
        if self.coordinator.poll() is not None:
            log.warning(
                "coordinator exited (%s); restarting it on its journal", self.coordinator.poll()
            )
            self.restart_coordinator()
        for shard in self.shards:
            code = shard.poll()
            if code is not None and len(self.exit_codes) < len(self.pipelines):
                if shard.restarts >= self.max_shard_restarts:
                    raise RuntimeError(f"{shard.name} keeps failing; see {shard.log_path}")
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
            elif proc.restarts < self.max_pipeline_restarts:
                log.warning(
                    "pipeline %s died (exit %s); resuming it from its checkpoint", pid, code
                )
                self.restart_pipeline(pid)
            else:
                self.exit_codes[pid] = code
                raise RuntimeError(f"pipeline {pid} failed (exit {code}); see {proc.log_path}")
        return len(self.exit_codes) < len(self.pipelines)

    def run(self, poll_s: float = 0.5, on_poll: Any = None) -> None:
        """Start and supervise until every pipeline finished; always stops everything.

        SIGTERM is turned into KeyboardInterrupt so the cleanup runs for it too.
        """

        def _terminated(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            self._run(poll_s, on_poll)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self, poll_s: float, on_poll: Any) -> None:
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
        rest = [*self.shards, *([self.coordinator] if self.coordinator else [])]
        for proc in rest:
            proc.terminate()
        deadline = time.monotonic() + 15
        for proc in rest:
            proc.stop(max(0.1, deadline - time.monotonic()))
        for p in self.cfg.pipelines:
            remove_pipeline_segments(p.id)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("OMP_NUM_THREADS", "1")  # many small processes share few cores
    env["PYTHONUNBUFFERED"] = "1"
    return env
