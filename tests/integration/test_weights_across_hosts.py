"""A version crossing to other hosts (network namespaces, tc-shaped links): once per
node with node caches, once per worker without. Runs the benchmark command itself
(``rlix-async bench weights --hosts N``), small, and checks what it measured from the
kernel's counters, not its timings."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.multinode

CLI = [sys.executable, "-m", "rlix_async.cli", "bench", "weights"]


def _bench(path: str, hosts: int, *extra: str) -> dict[str, Any]:
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


@pytest.mark.timeout(600)
def test_a_sleeping_nodes_cache_takes_the_version_before_its_shards_wake() -> None:
    """Shards asleep while the version is published: with prefetch the node's cache
    holds it when they wake, and their loads read it there (nothing staged). (Without
    prefetch nothing moves until a worker asks: tests/integration/test_node_cache.py.)"""
    prefetched = _bench("node", 1, "--wake-after", "4")
    row = prefetched["versions"][0]
    assert row["nodes_holding_at_wake"] == 1 and row["worker_staged_bytes"] == 0, prefetched
    assert row["torn_loads"] == 0, prefetched


@pytest.mark.timeout(600)
def test_a_killed_relay_and_a_link_down_for_10_s_cost_no_torn_load() -> None:
    """A relaying node's receiver SIGKILLed mid-version: the node behind it and the
    victim's successor (started again, as launch does) both end up holding the version,
    and no worker loads part of one. A node's link down 10 s mid-version: it catches up
    with no process started again."""
    killed = _bench("node", 2, "--fault", "kill-relay")
    row = killed["versions"][0]
    victim = str(row["fault"]["host"])
    assert row["fault"]["pids"] and row["torn_loads"] == 0, killed
    assert set(row["seconds_each_node_holds"]) == {"1", "2"}, killed
    assert killed["receiver_starts"][victim] == 2, killed  # killed once, started again
    cut = _bench("node", 2, "--fault", "link-down")
    row = cut["versions"][0]
    assert row["torn_loads"] == 0 and set(row["seconds_each_node_holds"]) == {"1", "2"}, cut
    assert row["seconds_each_node_holds"][str(row["fault"]["host"])] >= 10.0, cut  # cut off
    assert set(cut["receiver_starts"].values()) == {1}, cut  # no restart
