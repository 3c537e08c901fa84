"""A version crossing to other hosts (network namespaces, tc-shaped links): once per
node with node caches, once per worker without. Runs the benchmark command itself
(``rlix-async bench weights --hosts N``), small, and checks what it measured from the
kernel's counters, not its timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multinode

CLI = [sys.executable, "-m", "rlix_async.cli", "bench", "weights"]


def _bench(path: str, hosts: int, *extra: str) -> dict[str, float]:
    argv = [*CLI, "--hosts", str(hosts), "--shards-per-host", "1", "--tp", "2"]
    argv += ["--link-mbit", "400", "--size-mb", "16", "--bucket-mb", "4"]
    argv += ["--path", path, "--versions", "1", "--json", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(600)
def test_each_version_leaves_the_owner_once_relayed_once_per_node_or_once_per_worker() -> None:
    relayed = _bench("node", hosts=2)
    # two hosts, the second taking it from the first: the model left the owner once
    assert 0.95 <= relayed["owner_egress_per_model"] <= 1.1, relayed
    assert relayed["versions"][0]["worker_staged_bytes"] == 0  # workers read the node's slot
    node = _bench("node", 2, "--no-relay")
    # each node cache pulled from the owner: twice
    assert 1.9 <= node["owner_egress_per_model"] <= 2.2, node
    worker = _bench("worker", hosts=1)
    # one host, a tp=2 shard: each rank pulled its own private copy
    assert 1.9 <= worker["owner_egress_per_model"] <= 2.2, worker
    assert worker["versions"][0]["worker_staged_bytes"] > 0
