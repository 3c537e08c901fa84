"""The placement: ``launch --dry-run`` shows every process and its devices, bad
topologies fail before anything starts, and the real launch starts exactly the plan."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers.cluster import rlix

TWO_NODES = """
out: {out}
cluster: {{nodes: 2, gpus_per_node: 4}}
pipelines:
  - id: math
    model: {{path: /models/m}}
    clusters:
      actor_train: {{tp: 1, devices: [0, 1]}}
      actor_infer: {{tp: 2, devices: [0, 1, 2, 3]}}
  - id: code
    model: {{path: /models/m}}
    clusters:
      actor_train: {{tp: 1, devices: [4, 5]}}
      actor_infer: {{tp: 2, devices: [4, 5, 6, 7]}}
"""


def dry_run(tmp_path: Path, text: str, *overrides: str) -> dict:  # type: ignore[type-arg]
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(text.format(out=tmp_path / "out"))
    out = rlix("launch", str(cfg), "--dry-run", "--json", *overrides)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_dry_run_binds_every_process_to_its_devices_on_two_nodes(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, TWO_NODES)["processes"]
    assert not (tmp_path / "out").exists()  # nothing written, nothing started
    rows = {(p["role"], p["pipeline"], p["rank"]): p for p in plan}
    assert rows[("coordinator", None, None)]["env"] == {"CUDA_VISIBLE_DEVICES": ""}
    expected = {  # (role, pipeline, rank): (node, global devices, CUDA_VISIBLE_DEVICES)
        ("shard", "math", 0): (0, [0, 1], "0,1"),
        ("shard", "math", 1): (0, [2, 3], "2,3"),
        ("shard", "code", 0): (1, [4, 5], "0,1"),
        ("shard", "code", 1): (1, [6, 7], "2,3"),
        ("trainer", "math", None): (0, [0, 1], "0,1"),
        ("trainer", "code", None): (1, [4, 5], "0,1"),
    }
    for key, (node, devices, visible) in expected.items():
        p = rows[key]
        assert (p["node"], p["devices"], p["env"]["CUDA_VISIBLE_DEVICES"]) == (
            node,
            devices,
            visible,
        ), key
    assert len(plan) == 1 + len(expected)
    for p in plan:
        if p["role"] == "shard":  # vLLM runs tensor parallel over exactly its bundle
            assert p["config"]["tensor_parallel_size"] == 2
            assert p["config"]["devices"] == p["devices"]
            assert p["argv"][-2:] == ["--config", p["config_path"]]
        if p["role"] == "trainer":
            assert "--nproc-per-node=2" in p["argv"]
            assert p["config"]["clusters"]["actor_train"]["devices"] == p["devices"]
    # in this config the pipelines' devices are disjoint, so no two processes of one
    # role share a device (the plan only binds; overlaps come from the topology)
    for role in ("shard", "trainer"):
        seen: set[int] = set()
        for p in plan:
            if p["role"] == role:
                assert not seen & set(p["devices"]), (role, p)
                seen |= set(p["devices"])


def test_dry_run_shows_each_trainer_ranks_place_in_the_tensor_parallel_layout(
    tmp_path: Path,
) -> None:
    """Megatron at tensor parallel 2 over 4 devices: ranks 0-1 and 2-3 are the two
    replicas (data parallel 2); one torchrun rank per device."""
    text = """
out: {out}
cluster: {{nodes: 2, gpus_per_node: 4}}
pipelines:
  - id: big
    train: {{backend: megatron}}
    model: {{hidden: 128}}
    clusters:
      actor_train: {{tp: 2, devices: [4, 5, 6, 7]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""
    plan = dry_run(tmp_path, text)["processes"]
    (trainer,) = [p for p in plan if p["role"] == "trainer"]
    assert "--nproc-per-node=4" in trainer["argv"]
    assert [(r["node"], r["device"], r["tp"], r["pp"], r["dp"]) for r in trainer["ranks"]] == [
        (1, 4, 0, 0, 0), (1, 5, 1, 0, 0), (1, 6, 0, 0, 1), (1, 7, 1, 0, 1),
    ]  # fmt: skip
    # pipeline parallel 2 of two layers: tp=1 ranks 0-1 are one replica's stages, as
    # Megatron's tp-pp-dp order (the trainer's) places them
    text = text.replace("hidden: 128", "hidden: 128, layers: 2").replace(
        "tp: 2, devices: [4", "pp: 2, devices: [4"
    )
    plan = dry_run(tmp_path, text)["processes"]
    (trainer,) = [p for p in plan if p["role"] == "trainer"]
    assert [(r["device"], r["tp"], r["pp"], r["dp"]) for r in trainer["ranks"]] == [
        (4, 0, 0, 0), (5, 0, 1, 0), (6, 0, 0, 1), (7, 0, 1, 1),
    ]  # fmt: skip


def test_dry_run_shows_each_trainer_ranks_place_in_the_expert_parallel_layout(
    tmp_path: Path,
) -> None:
    """A Qwen3-MoE model (4 experts) at pp 2 and ep 2 over 4 devices: Megatron's
    tp-ep-dp-pp order puts each stage's ranks together (0-1, 2-3), and the two replicas
    of a stage hold one half of the experts each (one expert replica)."""
    from helpers.tiny_text import save_tiny_model

    model = save_tiny_model(tmp_path / "moe", "qwen3_moe")
    text = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 4}}
pipelines:
  - id: moe
    train: {{backend: megatron}}
    model: {{path: MODEL}}
    clusters:
      actor_train: {{pp: 2, ep: 2, devices: [0, 1, 2, 3]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
""".replace("MODEL", str(model))
    plan = dry_run(tmp_path, text)["processes"]
    (trainer,) = [p for p in plan if p["role"] == "trainer"]
    assert [(r["tp"], r["pp"], r["ep"], r["dp"], r["edp"]) for r in trainer["ranks"]] == [
        (0, 0, 0, 0, 0), (0, 0, 1, 1, 0), (0, 1, 0, 0, 0), (0, 1, 1, 1, 0),
    ]  # fmt: skip


def test_a_trainer_across_nodes_is_a_torchrun_job_per_node_meeting_at_rank0s_address(
    tmp_path: Path,
) -> None:
    """actor_train devices [3, 4] on two nodes: node 0 runs rank 0 (the driver, the
    pipeline's log and config) and node 1 rank 1, each a --standalone job told its place;
    both meet on rank 0's store at node 0's listed address."""
    plan = dry_run(
        tmp_path, TWO_NODES, "pipelines[0].clusters.actor_train.devices=[3,4]",
        'node_addresses=["10.0.0.1","10.0.0.2"]', "trainer_port=29800",
    )["processes"]  # fmt: skip
    parts = [p for p in plan if p["role"] == "trainer" and p["pipeline"] == "math"]
    assert [(p["node"], p["devices"], p["env"]["CUDA_VISIBLE_DEVICES"]) for p in parts] == [
        (0, [3], "3"), (1, [4], "0"),
    ]  # fmt: skip
    assert [[(r["rank"], r["node"], r["device"]) for r in p["ranks"]] for p in parts] == [
        [(0, 0, 3)], [(1, 1, 4)],
    ]  # fmt: skip
    assert [p["env"]["RLIX_TRAINER_FIRST_RANK"] for p in parts] == ["0", "1"]
    assert {p["env"]["RLIX_TRAINER_WORLD"] for p in parts} == {"2"}
    assert all("--nproc-per-node=1" in p["argv"] for p in parts)
    assert {p["config"]["trainer_endpoint"] for p in parts} == {"tcp://10.0.0.1:29800"}
    assert parts[0]["config_path"].endswith("math/pipeline.yaml")
    assert parts[1]["config_path"].endswith("math/pipeline-node1.yaml")
    # a trainer on one node has no endpoint and no span variables
    (code,) = [p for p in plan if p["role"] == "trainer" and p["pipeline"] == "code"]
    assert code["config"]["trainer_endpoint"] is None
    assert "RLIX_TRAINER_WORLD" not in code["env"]


@pytest.mark.parametrize("allowed", ["4,5,6,7", "GPU-aa,GPU-bb,GPU-cc,GPU-dd"])
def test_a_restricted_environment_gives_each_process_only_entries_of_its_list(
    tmp_path: Path, allowed: str
) -> None:
    """CUDA_VISIBLE_DEVICES already set (a SLURM job's gres, or the user): node-local
    device k is the k-th entry (indices or UUIDs alike); global ids stay the planner's."""
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(TWO_NODES.format(out=tmp_path / "out"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": allowed}
    env.pop("CUDA_DEVICE_ORDER", None)
    out = rlix("launch", str(cfg), "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    rows = {(p["role"], p["pipeline"], p["rank"]): p for p in json.loads(out.stdout)["processes"]}
    entries = allowed.split(",")
    assert rows[("coordinator", None, None)]["env"]["CUDA_VISIBLE_DEVICES"] == ""
    expected = {  # local indices 0,1 and 2,3 on each node
        ("shard", "math", 1): ([2, 3], entries[2:4]),
        ("shard", "code", 0): ([4, 5], entries[0:2]),
        ("trainer", "code", None): ([4, 5], entries[0:2]),
    }
    for key, (devices, visible) in expected.items():
        p = rows[key]
        assert p["devices"] == devices, key
        assert p["env"]["CUDA_VISIBLE_DEVICES"].split(",") == visible, key
        assert p["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", key  # NVML's (and SLURM's) order
    for p in rows.values():
        if p["devices"]:
            assert set(p["env"]["CUDA_VISIBLE_DEVICES"].split(",")) <= set(entries), p


def test_a_plan_needing_more_devices_than_the_environment_allows_is_refused(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(TWO_NODES.format(out=tmp_path / "out"))
    out = rlix("launch", str(cfg), "--dry-run", env={**os.environ, "CUDA_VISIBLE_DEVICES": "3,1"})
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "CUDA_VISIBLE_DEVICES=3,1 lets this launch use 2 devices there" in line, line


def test_dry_run_prints_a_table(tmp_path: Path) -> None:
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(TWO_NODES.format(out=tmp_path / "out"))
    out = rlix("launch", str(cfg), "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:6] == [
        "ROLE",
        "PIPELINE",
        "RANK",
        "NODE",
        "DEVICES",
        "CUDA_VISIBLE_DEVICES",
    ]
    assert lines[4].split()[:6] == ["shard", "code", "0", "1", "4,5", "0,1"]


def test_dry_run_says_when_the_users_own_binding_goes_to_every_process(tmp_path: Path) -> None:
    """With VLLM_CPU_OMP_THREADS_BIND set, the launcher binds nothing itself: no CPUS
    column, and one line saying the user's value reaches every process."""
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(TWO_NODES.format(out=tmp_path / "out"))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    out = rlix("launch", str(cfg), "--dry-run", env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "CPUS" not in lines[0]
    assert lines[-1] == "CPUS: every process gets your VLLM_CPU_OMP_THREADS_BIND=0-1|2-3"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["pipelines[0].clusters.actor_infer.devices=[0,1,2]"],
            "pipelines[0].clusters: cluster actor_infer: 3 devices is not a multiple of tp=2",
        ),
        (
            ["pipelines[0].clusters.actor_train.devices=[3,4]"],
            "pipelines[0].clusters.actor_train.devices: [3, 4] span nodes [0, 1]: a trainer "
            "across nodes needs node_addresses",
        ),
        (
            ['node_addresses=["10.0.0.1"]'],
            "node_addresses: 1 addresses for 2 nodes",
        ),
        (
            ["pipelines[1].nproc=1"],
            "pipelines[1].nproc: 1 ranks for 2 actor_train devices [4, 5]: each rank gets "
            "exactly one device",
        ),
        (
            ["pipelines[0].clusters.actor_train.tp=2"],
            "pipelines[0].clusters.actor_train.tp: 2: the torch backend is data parallel only "
            "(use tp: 1, pp: 1, ep: 1; tensor, pipeline and expert parallel are the megatron "
            "backend's)",
        ),
        (
            ["pipelines[0].clusters.actor_train.pp=2"],
            "pipelines[0].clusters.actor_train.pp: 2: the torch backend is data parallel only "
            "(use tp: 1, pp: 1, ep: 1; tensor, pipeline and expert parallel are the megatron "
            "backend's)",
        ),
        (
            [
                "pipelines[0].train.backend=megatron",
                "pipelines[0].model.path=null",
                "pipelines[0].model.layers=3",
                "pipelines[0].clusters.actor_train.pp=2",
            ],
            "pipelines[0].clusters.actor_train.pp: 2: the model's 3 layers do not split into "
            "as many per stage",
        ),
        (
            [
                "pipelines[0].train.backend=megatron",
                "pipelines[0].model.path=null",
                "pipelines[0].model.layers=2",
                "pipelines[0].clusters.actor_train.pp=2",
                "pipelines[0].clusters.actor_train.devices=[0,1,2]",
            ],
            "pipelines[0].clusters.actor_train.devices: 3 devices: a replica spans tp x pp = 2, "
            "so they must be a multiple of it",
        ),
        (
            ["pipelines[0].clusters.actor_infer.pp=2"],
            "pipelines[0].clusters: cluster actor_infer: pp=2: pipeline parallel is "
            "actor_train's only",
        ),
        (
            ["pipelines[0].train.backend=megatron", "pipelines[0].clusters.actor_train.tp=2"],
            "pipelines[0].model.path: no readable config.json to split over tp=2",
        ),
        (
            [
                "pipelines[0].train.backend=megatron",
                "pipelines[0].model.path=null",
                "pipelines[0].model.hidden=192",
                "pipelines[0].clusters.actor_train.tp=2",
            ],
            "pipelines[0].clusters.actor_train.tp: 2: the model has 3 attention heads in 3 "
            "query groups; tensor parallel must divide both",
        ),
        (
            [
                "pipelines[0].train.backend=megatron",
                "pipelines[0].model.path=null",
                "pipelines[0].model.hidden=512",  # 8 heads
                "pipelines[0].clusters.actor_train.tp=8",
                "pipelines[0].clusters.actor_train.devices=[0,1,2,3,4,5,6,7]",
            ],
            "tp=8 > gpus_per_node=4: a trainer's tensor-parallel group must fit one node",
        ),
        (
            ["pipelines[0].clusters.actor_train.devices=[8]"],
            "device",
        ),
        (
            [
                "pipelines[0].clusters.actor_infer.tp=8",
                "pipelines[0].clusters.actor_infer.devices=[0,1,2,3,4,5,6,7]",
            ],
            "pipelines[0].clusters.actor_infer.tp: 8 > gpus_per_node=4: a shard",
        ),
        (
            [  # vLLM refuses it only after its engine started: the launch refuses first
                "pipelines[0].model.path=null",
                "pipelines[0].model.hidden=64",  # one head
                "pipelines[0].clusters.actor_infer.tp=2",
                "pipelines[0].clusters.actor_infer.devices=[0,1]",
            ],
            "pipelines[0].clusters.actor_infer.tp: 2: the model has 1 attention heads",
        ),
    ],
)
def test_a_bad_topology_fails_before_any_process_starts(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(TWO_NODES.format(out=tmp_path / "out"))
    for args in (["--dry-run"], []):
        out = rlix("launch", str(cfg), *args, *overrides)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert message in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def test_a_weights_endpoint_without_keys_is_refused_before_any_process_starts(
    tmp_path: Path,
) -> None:
    """On one node a launch has no keys: a pipeline told to serve its weights over tcp
    would die at its first step (CURVE needs them), so the launch refuses it first."""
    cfg = tmp_path / "launch.yaml"
    engine = f"{Path(__file__).parents[1] / 'helpers' / 'pinned_engine.py'}:BACKEND"
    cfg.write_text(ONE_NODE.format(out=tmp_path / "out", engine=engine, pid="p"))
    for args in (["--dry-run"], []):
        out = rlix("launch", str(cfg), *args, "pipelines[0].weights_endpoint=tcp://127.0.0.1:*")
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "weights_endpoint tcp://127.0.0.1:* serves other nodes" in out.stderr
    assert not (tmp_path / "out").exists()


def test_launch_runs_one_node_and_says_how_to_run_more(tmp_path: Path) -> None:
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(TWO_NODES.format(out=tmp_path / "out"))
    out = rlix("launch", str(cfg))
    assert out.returncode == 2
    assert "cluster.nodes is 2" in out.stderr and "--node K" in out.stderr
    assert not (tmp_path / "out").exists()


ONE_NODE = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 3}}
engine: {{kind: custom, custom: "{engine}"}}
pipelines:
  - id: {pid}
    steps: 1
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    clusters:
      actor_train: {{tp: 1, devices: [1, 2]}}
      actor_infer: {{tp: 1, devices: [0, 1, 2]}}
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def _argv(pid: int) -> list[str]:
    """The process's argv. Empty for a moment after Popen returns: the kernel closes
    the child's close-on-exec pipe (Popen's signal that exec succeeded) before it has
    set up the new program's arguments, so a loaded machine can read in between."""
    deadline = time.monotonic() + 10
    while True:
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        if argv or time.monotonic() > deadline:
            return argv
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_the_real_launch_starts_exactly_the_dry_run_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scripted shards (a test double); the coordinator, shard and torchrun processes are
    real. On a host without GPUs each shard is also given its devices' cores, as the
    dry run shows them."""
    from rlix_async.config import (
        CoordinatorConfig,
        LaunchConfig,
        PipelineConfig,
        ShardConfig,
        convert,
        load_config,
    )
    from rlix_async.launch import Launcher
    from rlix_async.placement import _host_cores, cpu_binding

    kinds = {"coordinator": CoordinatorConfig, "shard": ShardConfig, "trainer": PipelineConfig}
    pid = f"pl{os.getpid() % 10000}"
    # the scripted engine, pinned as vllm-cpu is: the binding is its backend's to declare
    pinned = f"{Path(__file__).parents[1] / 'helpers' / 'pinned_engine.py'}:BACKEND"
    text = ONE_NODE.replace("{engine}", pinned).replace("{pid}", pid)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # a user's would win
    planned = dry_run(tmp_path, text)["processes"]
    launcher = Launcher(load_config(tmp_path / "launch.yaml", LaunchConfig))

    def real(value: str) -> str:  # the dry run names the coordinator's socket symbolically
        return value.replace("ipc://<coordinator.sock>", launcher.endpoint)

    cores = _host_cores()  # this host has no GPU: devices are shares of its cores
    assert cores or any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()

    def bound(devices: list[int]) -> str:
        return "|".join(",".join(map(str, c)) for c in cpu_binding(devices, 3, cores))

    try:
        launcher.start()
        procs = [launcher.coordinator, *launcher.shards, *launcher.pipelines.values()]
        assert len(procs) == len(planned)
        for want, proc in zip(planned, procs, strict=True):
            who = (want["role"], want["pipeline"], want["rank"])
            assert proc is not None and proc.popen is not None
            assert _argv(proc.popen.pid) == [real(a) for a in want["argv"]], who
            env = _environ(proc.popen.pid)
            assert {k: env.get(k) for k in want["env"]} == want["env"], who
            if cores and want["role"] == "shard":  # vllm-cpu pins its threads there
                assert env["VLLM_CPU_OMP_THREADS_BIND"] == bound(want["devices"]), who
                # and the dry run showed it (the env check above compares the rest)
                assert want["env"]["VLLM_CPU_OMP_THREADS_BIND"] == bound(want["devices"]), who
            if cores and want["role"] == "trainer":  # its driver loop must not queue
                assert "VLLM_CPU_OMP_THREADS_BIND" not in env, who
            kind = kinds[want["role"]]
            written = load_config(want["config_path"], kind)
            config = json.loads(real(json.dumps(want["config"])))
            assert written == convert(config, kind, "the dry run"), who
    finally:
        launcher.stop()
    deadline = time.monotonic() + 10
    while subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout:
        assert time.monotonic() < deadline, "launch left processes behind"
        time.sleep(0.2)


CROSSING = """
out: {out}
cluster: {{nodes: 3, gpus_per_node: 2}}
pipelines:
  - id: near
    model: {{path: /models/m}}
    clusters:
      actor_train: {{tp: 1, devices: [2]}}
      actor_infer: {{tp: 1, devices: [3, 4]}}
  - id: far
    model: {{path: /models/m}}
    clusters:
      actor_train: {{tp: 1, devices: [5]}}
      actor_infer: {{tp: 1, devices: [3]}}
"""


def test_each_node_runs_its_share_wired_across_nodes(tmp_path: Path) -> None:
    """`launch --node K`: node 0 runs the coordinator; a shard away from its trainer
    serves its data plane on tcp at its node's address, a trainer with shards on other
    nodes serves its weights on tcp; everything on one node stays on ipc/shared memory."""
    from rlix_async.config import LaunchConfig, load_config
    from rlix_async.placement import node_share, place_processes

    path = tmp_path / "c.yaml"
    path.write_text(CROSSING.format(out=tmp_path / "out"))
    cfg = load_config(path, LaunchConfig)

    def share(node: int, address: str) -> dict[tuple[str, str | None, int | None], object]:
        plan = place_processes(cfg, tmp_path / "out", "tcp://10.0.0.1:7600", keys="/k")
        return {(p.role, p.pipeline, p.rank): p.config for p in node_share(plan, node, address)}

    assert list(share(0, "10.0.0.1")) == [("coordinator", None, None)]
    one = share(1, "10.0.0.2")
    # far's owner is on node 2: node 1 receives far's versions once, for its shard
    assert sorted(one, key=str) == sorted(
        [
            ("shard", "near", 0),
            ("shard", "far", 0),
            ("trainer", "near", None),
            ("node_cache", "far", None),
        ],
        key=str,
    )
    assert one[("shard", "near", 0)].data_endpoint is None  # its router is on this node
    assert one[("shard", "far", 0)].data_endpoint == "tcp://10.0.0.2:*"
    assert one[("trainer", "near", None)].weights_endpoint == "tcp://10.0.0.2:*"
    two = share(2, "10.0.0.3")
    assert two[("shard", "near", 1)].data_endpoint == "tcp://10.0.0.3:*"
    assert two[("trainer", "far", None)].weights_endpoint == "tcp://10.0.0.3:*"
    assert ("node_cache", "near", None) in two and ("node_cache", "far", None) not in two
    configs = [c for c in [*one.values(), *two.values()] if c is not None]
    assert {c.keys for c in configs} == {"/k"}  # type: ignore[attr-defined]
    plan = place_processes(cfg, tmp_path / "out", "tcp://10.0.0.1:7600", keys="/k")
    receiver = next(p for p in node_share(plan, 1, "10.0.0.2") if p.role == "node_cache")
    assert receiver.argv[-6:] == ["--pipeline", "far", "--keys", "/k", "--address", "10.0.0.2"]
    # far's weights.prefetch: false reaches its receiver (a node short of host memory)
    path.write_text(
        CROSSING.format(out=tmp_path / "out").replace(
            "actor_infer: {tp: 1, devices: [3]}",
            "actor_infer: {tp: 1, devices: [3]}\n    weights: {prefetch: false}",
        )
    )
    plan = place_processes(load_config(path, LaunchConfig), tmp_path / "out", "tcp://x:1")
    receiver = next(p for p in node_share(plan, 1, "10.0.0.2") if p.role == "node_cache")
    assert receiver.argv[-1] == "--no-prefetch"


def test_a_node_waits_for_the_shards_elsewhere_of_the_pipelines_it_drives(
    tmp_path: Path,
) -> None:
    from rlix_async.config import LaunchConfig, load_config
    from rlix_async.placement import place_processes
    from rlix_async.remote_shards import remote_shards

    path = tmp_path / "c.yaml"
    path.write_text(CROSSING.format(out=tmp_path / "out"))
    plan = place_processes(load_config(path, LaunchConfig), tmp_path / "out", "tcp://h:1")
    # near's driver on node 1, its second shard (device 4) on node 2; far's driver on
    # node 2, its shard on node 1; node 0 drives nothing
    assert remote_shards(plan, 0) == {}
    assert remote_shards(plan, 1) == {"near": {1}}
    assert remote_shards(plan, 2) == {"far": {0}}


def test_the_launchs_heartbeat_period_reaches_the_coordinator_and_the_shards(
    tmp_path: Path,
) -> None:
    """A loaded host needs a longer wait before its processes are declared dead: the
    launch's ``heartbeat_interval_s`` is the coordinator's (its welcome hands the
    timeout to every client) and every shard's, whose data server declares a silent
    router dead (on the main demo's 2 loaded cores routers went silent 2.6 s)."""
    from rlix_async.config import LaunchConfig, load_config
    from rlix_async.placement import place_processes

    path = tmp_path / "c.yaml"
    path.write_text(CROSSING.format(out=tmp_path / "out") + "heartbeat_interval_s: 2.5\n")
    plan = place_processes(load_config(path, LaunchConfig), tmp_path / "out", "tcp://10.0.0.1:7600")
    coordinator = plan[0].config
    assert plan[0].role == "coordinator" and coordinator.heartbeat_interval_s == 2.5  # type: ignore[attr-defined]
    shards = [p.config for p in plan if p.role == "shard"]
    assert shards and all(s.heartbeat_interval_s == 2.5 for s in shards)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("train", "infer", "said"),
    # (a shard's bundle across nodes is refused by the topology check already)
    [([1, 2], [0], "span nodes"), ([0], [1, 2], "crosses a node boundary")],
)
def test_a_trainer_or_shard_split_over_nodes_is_refused_before_anything_starts(
    tmp_path: Path, train: list[int], infer: list[int], said: str
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"out: {tmp_path / 'out'}\ncluster: {{nodes: 2, gpus_per_node: 2}}\npipelines:\n"
        f"  - id: x\n    model: {{path: /m}}\n    clusters:\n"
        f"      actor_train: {{tp: 1, devices: {train}}}\n"
        f"      actor_infer: {{tp: {len(infer)}, devices: {infer}}}\n"
    )
    run = rlix("launch", str(cfg), "--dry-run")
    assert run.returncode == 2
    assert said in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--node", "1"], "--node needs --coordinator, --address, --keys"),
        (["--node", "3", "--coordinator", "tcp://10.0.0.1:7600", "--address", "10.0.0.2",
          "--keys", "KEYS", "--job", "j"], "--node 3: cluster.nodes is 3"),
        (["--node", "1", "--coordinator", "ipc:///tmp/x", "--address", "10.0.0.2",
          "--keys", "KEYS", "--job", "j"], "nodes meet on tcp://HEAD:PORT"),
        (["--node", "1", "--coordinator", "tcp://10.0.0.1:7600", "--address", "10.0.0.2",
          "--keys", "KEYS", "--job", "j"], "server.key: missing"),
        (["--address", "10.0.0.2"], "go with --node K"),
        (["--node", "1", "--coordinator", "tcp://10.0.0.1:7600", "--address", "10.0.0.3",
          "--keys", "KEYS", "--job", "j", 'node_addresses=["10.0.0.1","10.0.0.2","10.0.0.4"]'],
         "--address 10.0.0.3: node_addresses[1] is 10.0.0.2"),
        (["--node", "1", "--coordinator", "tcp://10.0.0.1:7600", "--address", "10.0.0.2",
          "--keys", "KEYS", "--job", "j", 'node_addresses=["10.0.0.1","10.0.0.2","10.0.0.4"]',
          "pipelines[0].clusters.actor_train.devices=[2,4]"],
         "driver-near.key_secret: missing; pipeline near's trainer spans nodes [1, 2]"),
    ],
)  # fmt: skip
def test_a_node_launch_with_bad_flags_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], said: str
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CROSSING.format(out=tmp_path / "out"))
    run = rlix("launch", str(cfg), *[a.replace("KEYS", str(tmp_path / "k")) for a in args])
    assert run.returncode == 2, run.stderr
    assert said in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "out").exists()


def test_a_node_refuses_an_earlier_runs_done_markers_unless_resuming(tmp_path: Path) -> None:
    """A rerun under an old --job would end at once on the old markers (or fail on a
    failed one): refused in one line; --resume continues that run instead."""
    from rlix_async.security import keygen

    keygen(tmp_path / "k")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CROSSING.format(out=tmp_path / "out"))
    marks = tmp_path / "out" / "nodes" / "j1"
    marks.mkdir(parents=True)
    (marks / "near.exit").write_text("0\n")
    flags = ["--node", "1", "--coordinator", "tcp://10.0.0.1:7600", "--address", "10.0.0.2",
             "--keys", str(tmp_path / "k"), "--job", "j1"]  # fmt: skip
    run = rlix("launch", str(cfg), *flags)
    assert run.returncode == 2
    assert "done-markers of an earlier run with --job j1" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
