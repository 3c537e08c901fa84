"""The ``rlix-async`` command in child processes: subcommands, config checking, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cluster import ROOT, joined_pipeline, rlix
from helpers.snapshots import EXAMPLE as SNAPSHOT

from rlix_async.observe.trace import trace_problems

SCENARIO = """
cluster: {nodes: 1, gpus_per_node: 2}
pipelines:
  - id: solo
    steps: 3
    step_target: 4
    max_trajectory_age_steps: 0
    slots_per_shard: 4
    rollout: {dist: fixed, median_s: 10}
    stages: {ACTOR_TRAINING: 5}
    clusters:
      actor_train: {tp: 1, devices: [1]}
      actor_infer: {tp: 1, devices: [0]}
"""


def test_help_lists_subcommands() -> None:
    out = rlix("--help")
    assert out.returncode == 0
    for cmd in ("keygen", "bench", "launch", "coordinator", "shard", "config", "simulate"):
        assert cmd in out.stdout


def test_importing_the_config_loads_no_torch() -> None:
    code = (
        "import sys, rlix_async.config, rlix_async.cli; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_keygen(tmp_path: Path) -> None:
    out = rlix("keygen", str(tmp_path / "keys"), "--client", "node1")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "keys" / "authorized" / "node1.key").exists()


def test_keygen_writes_a_driver_allowance_and_revokes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    driver = ["--client", "d", "--role", "driver", "--pipeline", "p"]
    out = rlix("keygen", str(keys), *driver, "--devices", "0-3,8,10-11", "--max-weight", "4",
               "--max-priority", "ACTOR_TRAINING", "--group", "g1", "--group", "g2",
               "--max-hold", "3600")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (keys / "authorized" / "d.allow").read_text() == (
        "devices 0-3,8,10-11\nmax_weight 4\nmax_priority ACTOR_TRAINING\ngroups g1,g2\n"
        "max_hold 3600\n"
    )
    for bad, message in [
        (["--devices", "3-1"], "devices '3-1': '3-1' is not a range"),
        (["--max-priority", "TOP"], "--max-priority TOP: one of INITIALIZATION"),
        (["--max-weight", "0"], "--max-weight 0.0: must be > 0"),
        (["--max-hold", "-1"], "--max-hold -1.0: must be > 0 seconds"),
    ]:
        out = rlix("keygen", str(keys), *driver, *bad)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    out = rlix("keygen", str(keys), "--client", "s", "--role", "shard", "--pipeline", "p",
               "--devices", "0")  # fmt: skip
    assert out.returncode == 2 and "are for --role driver" in out.stderr
    out = rlix("keygen", str(keys), "--revoke", "d")
    assert out.returncode == 0, out.stderr
    assert not (keys / "authorized" / "d.key").exists() and not (keys / "d.key_secret").exists()
    out = rlix("keygen", str(keys), "--revoke", "d")
    assert out.returncode == 2 and "holds no key 'd'" in out.stderr


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        (
            "pipelines: [{id: a, clusters: {actor_train: {devices: [0]}, "
            "actor_infer: {devices: [0, 1]}}, rollout: {groupsize: 3}}]",
            [],
            "bad.yaml: pipelines[0].rollout.groupsize: unknown key (did you mean group_size?)",
        ),
        (
            "pipelines: [{id: a, clusters: {actor_train: {devices: [0]}, "
            "actor_infer: {devices: [0, 9]}}}]",
            [],
            "bad.yaml: pipelines[0].clusters: cluster actor_infer: devices [9] do not exist",
        ),
        (
            "pipelines: [{id: a, clusters: {actor_train: {devices: [0]}, "
            "actor_infer: {devices: [0, 1]}}}]",
            ["pipelines[0].train.loss.kind=ppo"],
            "bad.yaml: pipelines[0].train.loss.kind: invalid value 'ppo' (one of cispo, dapo)",
        ),
        ("pipelines: [", [], "bad.yaml:1: not valid YAML"),
    ],
)
def test_a_bad_launch_config_is_one_line_and_exit_2(
    tmp_path: Path, text: str, overrides: list[str], message: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    for cmd in (["launch", str(bad)], ["config", "check", str(bad)]):
        out = rlix(*cmd, *overrides)
        assert out.returncode == 2, out
        assert out.stderr.startswith(f"error: {tmp_path}/{message}"), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "rlix-out").exists()  # nothing started


def test_process_commands_refuse_bad_keys_before_starting() -> None:
    out = rlix("coordinator", "cluster.nodes=0")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: the command line: cluster.nodes: expected int >= 1"
    out = rlix("shard", "pipeline=p", "rank=0")  # vllm without a model
    assert out.returncode == 2
    assert "model: a vllm engine needs a model directory" in out.stderr
    out = rlix("shard", "pipeline=p", "rank=0", "engine.kind=custom", "engine.custom=nope:X")
    assert (
        out.returncode == 2
        and out.stderr.strip()
        == "error: shard p/0: engine.custom: cannot import nope: No module named 'nope'"
    )


def test_shipped_configs_are_valid_and_the_reference_is_current() -> None:
    out = rlix("config", "check", "examples/pipelines.yaml")
    assert out.returncode == 0, out.stderr
    for scenario in sorted((ROOT / "scenarios").glob("*.yaml")):
        out = rlix("config", "check", str(scenario), "--kind", "scenario")
        assert out.returncode == 0, (scenario, out.stderr)
    shown = rlix("config", "check", "examples/pipelines.yaml", "--show", "pipelines[0].steps=3")
    assert "steps: 3" in shown.stdout and "lease_timeout_s: 60.0" in shown.stdout
    reference = rlix("config", "reference")
    assert reference.returncode == 0
    assert reference.stdout == (ROOT / "docs" / "CONFIG.md").read_text(), (
        "docs/CONFIG.md is stale: rlix-async config reference > docs/CONFIG.md"
    )


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_bench_rpc_json(transport: str) -> None:
    out = rlix("bench", "rpc", "--transport", transport, "--calls", "300", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["p50_us"] > 0 and result["p99_us"] >= result["p50_us"]
    assert result["throughput_rps"] > 100
    if transport == "ipc":  # the floors are timed in the same rounds
        for floor in ("zmq_floor", "asyncio_floor"):
            assert result[f"{floor}_p99_us"] >= result[f"{floor}_p50_us"] > 0


def test_bench_rpc_pinned() -> None:
    """--pin shared puts client and server on one CPU (the placement PERF.md quotes)."""
    out = rlix("bench", "rpc", "--pin", "shared", "--calls", "300", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["pin"] == "shared"
    assert result["client_cpus"] == result["server_cpus"] and len(result["server_cpus"]) == 1
    assert result["p99_us"] >= result["p50_us"] > 0


def test_plan_cli(tmp_path: Path) -> None:
    good = tmp_path / "snap.json"
    good.write_text(SNAPSHOT)
    out = rlix("plan", str(good), "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"grants", "shrink", "expand", "waiting", "idle_devices"}
    assert result["grants"] == [
        {"pipeline": "A", "cluster": "actor_train", "priority": "ACTOR_TRAINING", "devices": [0, 1]}
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(SNAPSHOT.replace('"tp": 1, "devices": [0, 1]}', '"tp": 1, "devices": [1, 0]}'))
    out = rlix("plan", str(bad), timeout=60)
    assert out.returncode == 2
    assert "$.pipelines[0].clusters: cluster actor_train: devices must be sorted" in out.stderr


def test_simulate_json_shape_and_journal_for_timeline(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    out = rlix("simulate", str(path), "--json", "--journal", str(tmp_path / "j.jsonl"), check=True)
    data = json.loads(out.stdout)
    assert set(data["policies"]) == {"exclusive", "static", "timeshare", "fair"}
    for r in data["policies"].values():
        assert {
            "steps_per_hour_per_gpu",
            "makespan_s",
            "gpu_utilization",
            "mean_step_s",
            "timeline_s",
            "preemptions",
            "wasted_gpu_s",
            "reprefill_gpu_s",
        } <= set(r)
    # the top-level figures read the coordinator's default time-sharing (fair)
    assert data["policy"] == "fair"
    assert {"gain_vs_exclusive", "gain_vs_static", "fair_share_index", "duty_cycle"} <= set(data)
    assert data["duty_cycle"] == round(data["policies"]["fair"]["gpu_utilization"], 3)
    text = rlix("simulate", str(path), check=True).stdout
    assert "fair / exclusive:" in text and "fair / static:" in text and "duty cycle" in text
    png = tmp_path / "t.png"
    rlix("timeline", str(tmp_path / "j.jsonl"), "-o", str(png), check=True)
    assert png.stat().st_size > 0
    trace = tmp_path / "trace.json"
    rlix("trace", str(tmp_path / "j.jsonl"), "-o", str(trace), check=True)
    assert trace_problems(json.loads(trace.read_text())) == []
    bad = rlix("simulate", str(tmp_path / "nope.yaml"))
    assert bad.returncode == 2 and "nope.yaml: cannot read" in bad.stderr
    missing = rlix("timeline", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    sweep = rlix("simulate", str(path), "--seeds", "3", "--json", check=True)
    data = json.loads(sweep.stdout)
    assert [r["seed"] for r in data["runs"]] == [0, 1, 2]
    assert data["gain"]["min"] <= data["gain"]["mean"] <= data["gain"]["max"]
    assert data["gain_vs_static"]["min"] <= data["gain_vs_static"]["max"]
    generated = tmp_path / "g.yaml"
    rlix("scenario", "agentic", "--seed", "3", "--steps", "2", "-o", str(generated), check=True)
    out = rlix("simulate", str(generated), "--policy", "static", "--json", check=True)
    assert json.loads(out.stdout)["policies"]["static"]["devices"] == 8
    on_policy = rlix("simulate", str(generated), "--policy", "timeshare", "--json", check=True)
    asynchronous = rlix(
        "simulate",
        str(generated),
        "--policy",
        "timeshare",
        "--staleness",
        "1",
        "--json",
        check=True,
    )
    assert json.loads(on_policy.stdout) != json.loads(asynchronous.stdout)


async def test_trace_of_a_coordinators_journal(ipc_ep: str, tmp_path: Path) -> None:
    """A coordinator's own journal (what launch and the demo leave): two pipelines
    share devices, one trains over the other's shards; its trace opens in Perfetto."""
    import asyncio

    from rlix_async.control.coordinator import Coordinator
    from rlix_async.protocols.topology import ClusterShape, ClusterSpec

    journal = tmp_path / "journal.jsonl"
    topo = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}
    async with Coordinator(ipc_ep, ClusterShape(1, 4), journal=journal) as co:
        a = await joined_pipeline(co.endpoint, "A", topo)
        b = await joined_pipeline(co.endpoint, "B", topo)
        for pc in (a, b):
            await pc.report_progress(100, 0, force=True)
            await pc.request("actor_infer", "GENERATION", timeout=5)
        assert await a.request("actor_train", "ACTOR_TRAINING", timeout=10) == [0, 1]
        await asyncio.sleep(0.2)
        await a.release("actor_train")
        await a.close()
        await b.close()
    out = tmp_path / "trace.json"
    done = await asyncio.to_thread(rlix, "trace", str(journal), "-o", str(out))
    assert done.returncode == 0 and done.stdout.strip() == str(out), done.stderr
    trace = json.loads(out.read_text())
    assert trace_problems(trace) == []
    names = {e["name"] for e in trace["traceEvents"]}
    wanted = {"A rollout", "B rollout", "A shrink", "A fence", "A unfence", "A devices", "register"}
    assert wanted <= names, names
    train = [e for e in trace["traceEvents"] if e["name"] == "A train"]
    assert sorted(e["tid"] for e in train) == [1, 2]  # devices 0 and 1, held over the sleep
    assert all(e["ph"] == "X" and e["dur"] >= 200_000 for e in train), train


def test_the_pipeline_process_refuses_a_bad_config_before_starting(tmp_path: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text("id: p\nclusters: {actor_train: {devices: [0]}, actor_infer: {devices: [0]}}\n")
    run = [sys.executable, "-m", "rlix_async.pipeline", "--config", str(cfg)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {cfg}: coordinator: required (the coordinator's endpoint)"
    out = subprocess.run([*run, "steps=0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.strip() == f"error: {cfg}: steps: expected int >= 1"


def test_the_slurm_template_runs_launch_node_with_flags_that_exist() -> None:
    """launchers/slurm/rlix.sbatch is `rlix-async launch --node` once per node: it parses
    as bash and every flag it passes is one the launcher takes (the multinode tier runs
    the same command in network namespaces)."""
    import re

    sbatch = ROOT / "launchers" / "slurm" / "rlix.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)], timeout=30).returncode == 0
    text = sbatch.read_text()
    assert re.search(r'launch "\$PIPELINES" --node "\$SLURM_NODEID"', text)
    helptext = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    start = text.index('rlix-async" launch')
    command = text[start : text.index("\n'", start)]
    used = set(re.findall(r"(--[a-z][a-z-]+)", command))
    assert used == {"--node", "--coordinator", "--address", "--keys", "--job", "--resume"}
    assert all(flag in helptext for flag in used)


def test_a_coordinator_process_serves_metrics(tmp_path: Path, ipc_ep: str) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlix_async.cli", "coordinator", f"endpoint={ipc_ep}",
         f"metrics_port={port}", f"journal={tmp_path / 'j.jsonl'}"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"rlix_plans_applied" in body and b"rlix_devices_fenced" in body
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
