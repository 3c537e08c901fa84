"""Multi-node for real, on one machine: three hosts in network namespaces
(tests/helpers/hosts.py), each running ``rlix-async launch --node K`` exactly as a
user runs it on each machine of a cluster.

Host 0 runs the coordinator (tcp, CURVE keys from ``rlix-async keygen``); hosts 1
and 2 run vLLM shard workers and trainers, placed so that each pipeline's weights
cross hosts: ``near`` trains on host 1 and rolls out on host 1 (shared memory) and
host 2 (pulled over tcp from its trainer's weight server, with the shard's own key);
``far`` trains on host 2 and rolls out only on host 1. No device is shared
(time-sharing has its own tests): each pipeline's progress here is multi-node's
alone. One test, because each
start of the three hosts' vLLM engines costs a minute of CI: both pipelines train
across hosts, a host with the wrong keys is refused, then host 2 loses power
(every process in its namespace SIGKILLed): ``near`` goes on to the end on host
1, ``far``'s leases expire, and ``far`` resumes from its checkpoint when host 2's
launcher is started again.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.hosts import make_hosts
from helpers.multinode import CLI, journal, launch_on, logs, metrics, wait_for

pytest.importorskip("vllm")
pytestmark = [pytest.mark.multinode, pytest.mark.vllm]

CONFIG = """
out: {out}
cluster: {{nodes: 3, gpus_per_node: 3}}
scheduler: {{lease_timeout_s: 8}}
heartbeat_interval_s: 2  # three hosts' worth of processes start on 2 cores (CI: beside another test)
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 64}}
pipelines:
  - id: near
    seed: 1
    steps: {steps}
    checkpoint_every: 5
    keep_checkpoints: 2
    task: {{name: target_tokens, lo: 0, hi: 32}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, devices: [3]}}      # host 1
      actor_infer: {{tp: 1, devices: [4, 6]}}   # host 1 and host 2
  - id: far
    seed: 2
    steps: {steps}
    checkpoint_every: 5
    keep_checkpoints: 2
    task: {{name: target_tokens, lo: 256, hi: 288}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, devices: [7]}}      # host 2
      actor_infer: {{tp: 1, devices: [5]}}      # host 1: every sync crosses hosts
"""

STEPS = 150  # a tiny model steps in a fraction of a second: still mid-run at the kill


def _setup(tmp_path: Path, steps: int) -> tuple[Path, Path, Path]:
    from rlix_async.models.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=0, vocab_size=512, layers=1, hidden=64)
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keygen", str(keys)], check=True, capture_output=True, timeout=60)
    out = tmp_path / "out"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CONFIG.format(out=out, steps=steps, model=model))
    return cfg, out, keys


@pytest.mark.timeout(900)
def test_two_pipelines_train_across_hosts_and_one_survives_losing_a_host(tmp_path: Path) -> None:
    cfg, out, keys = _setup(tmp_path, steps=STEPS)
    # a client key the coordinator never authorized, with the right server key: the
    # coordinator itself must refuse it (not the client refuse an unknown server)
    wrong = tmp_path / "wrong-keys"
    subprocess.run([*CLI, "keygen", str(wrong)], check=True, capture_output=True, timeout=60)
    shutil.copyfile(keys / "server.key", wrong / "server.key")
    coordinator = None
    with make_hosts(3, tmp_path / "hosts") as hosts:
        coordinator = f"tcp://{hosts[0].address}:7611"
        for k in range(3):
            launch_on(hosts, k, cfg, keys, "mn")
        first = [proc for _, proc, _ in hosts.procs]
        # far's first steps (a checkpoint at 5): its rollouts came from a shard on the
        # other host over tcp, its weights went there from its trainer's weight server
        wait_for("far's checkpoint", lambda: len(metrics(out, "far")) >= 6, tmp_path, first)
        # and near's shard on host 2 pulled a version over tcp (a tiny model steps in
        # a fraction of a second: far can reach its checkpoint before that shard syncs)
        wait_for("near's second shard to sync across hosts", lambda: any(
            e["ev"] == "synced" and e["pipeline"] == "near" and e["rank"] == 1
            and e.get("version") is not None for e in journal(out)), tmp_path, first)  # fmt: skip

        # Host 2 loses power at once (far is mid-run): far's trainer and near's second
        # shard die with it.
        killed_at_step = len(metrics(out, "far"))
        assert hosts.kill_host(hosts[2])

        # Another host's view of the cluster: with the run's keys it is served...
        status = [*CLI, "status", "--endpoint", coordinator]
        # (the table, whoever is in it: near may have finished its steps already)
        seen = hosts.run(hosts[1], [*status, "--keys", str(keys)])
        assert "plans applied" in seen, seen
        # ... with keys the coordinator never authorized, it gets nothing.
        refused = hosts.run(hosts[1], [*status, "--keys", str(wrong)], timeout=120)
        assert "plans applied" not in refused and "error" in refused.lower(), refused

        wait_for("far's leases to expire", lambda: any(
            e["ev"] == "unregister" and e["pipeline"] == "far"
            and e.get("reason") == "lease expired" for e in journal(out)),
            tmp_path, first[:2])  # fmt: skip
        wait_for("near to finish without host 2", lambda: (
            out / "nodes" / "mn" / "near.exit").exists(), tmp_path, first[:2])  # fmt: skip
        assert (out / "nodes" / "mn" / "near.exit").read_text().strip() == "0"
        assert killed_at_step < STEPS and not (out / "nodes" / "mn" / "far.exit").exists()

        # Host 2 is back: its launcher resumes far from its newest checkpoint.
        launch_on(hosts, 2, cfg, keys, "mn", "--resume")
        wait_for("every launcher to end", lambda: all(
            proc.poll() is not None for _, proc, _ in hosts.procs[:2] + hosts.procs[3:]),
            tmp_path, timeout=420, hosts=hosts)  # fmt: skip
        codes = [proc.poll() for proc in [*first[:2], hosts.procs[-1][1]]]
        assert codes == [0, 0, 0], logs(tmp_path)

    near, far = metrics(out, "near"), metrics(out, "far")
    assert [r["step"] for r in near] == list(range(1, STEPS + 1)), logs(tmp_path)
    assert {r["step"] for r in far} == set(range(1, STEPS + 1)) and far[-1]["step"] == STEPS
    assert "resumed from" in (out / "logs" / "pipeline-far.log").read_text()
    log_dir = out / "logs"
    # the versions of near's second shard and far's only shard came over tcp from the
    # trainer's weight server, never through shared memory
    for pipeline in ("near", "far"):
        log = (log_dir / f"pipeline-{pipeline}.log").read_text()
        assert "serving weights at tcp://" in log
        # the bytes crossed hosts sealed (each transfer on weights.streams streams)
        assert re.search(r"weights: sealed stream \d+/\d+ of version", log), log[-2000:]
    events = journal(out)
    joined = {(e["pipeline"], e["rank"]): str(e["incarnation"]).split(":")[0] for e in events
              if e["ev"] == "shard_joined"}  # fmt: skip
    assert joined == {("near", 0): "host1", ("near", 1): "host2", ("far", 0): "host1"}
    synced = {(e["pipeline"], e["rank"], e["version"]) for e in events if e["ev"] == "synced"}
    assert any(p == "far" and v and v >= 1 for p, _, v in synced), sorted(synced)  # type: ignore[operator]
    # near's second shard (host 2) pulled at least its first version from host 1
    assert any(p == "near" and r == 1 and v is not None for p, r, v in synced), sorted(synced)
    # Each version left its trainer once per receiving node: to that node's cache
    # (weights/node_cache.py), whose workers read it from the node's shared memory.
    # (A resumed trainer numbers its versions from its checkpoint again: counted apart.)
    for pipeline, host in (("near", "host2"), ("far", "host1")):
        log = (log_dir / f"pipeline-{pipeline}.log").read_text()
        for part in log.split("resumed from"):
            # one transfer: its first stream's line (the others carry the same version)
            sent = re.findall(
                rf"sealed stream 1/\d+ of version (\d+) to {pipeline}/weights/(\w+)-", part
            )
            assert {h for _, h in sent} <= {host}, sent
            versions = [v for v, _ in sent]
            assert len(versions) == len(set(versions)), f"{pipeline}: a version sent twice {sent}"
    received = (log_dir / "node-cache-near-2.log").read_text()
    assert "received version" in received, received[-2000:]
