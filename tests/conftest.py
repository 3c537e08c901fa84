"""Test tiers and shared fixtures. ``tests/unit``: pure functions and in-memory objects;
``tests/integration``: real processes, sockets, engines and files; ``tests/helpers``:
what both use (helper processes, the scripted engine)."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator

import pytest
from helpers.cluster import Peer, start_peer

from rlix_async.security import ipc_endpoint

# Under pytest-xdist every worker is a run of its own: weight segments are named per
# RLIX_JOB (weights/shm.py), so one worker's cleanup never removes another's.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RLIX_JOB", f"pytest-{worker}-{os.getpid()}")

TIERS = ("slow", "vllm", "gpu", "multinode")


# Tests that start whole clusters or real engines (the slower tiers): under pytest-xdist
# (the README's test command runs two workers) they run one at a time on one worker,
# first, while the other worker takes everything else. Two of them at once on two
# cores starve each other's heartbeats.
HEAVY = ("slow", "vllm", "multinode")
# A slow test with no coordinator, leases or heartbeats to starve (torchrun jobs or an
# in-process trainer: only its own time to lose) marks itself ``beside_heavy``: it runs
# on the other worker, beside the heavy group, which is otherwise the whole run's wall.


@pytest.hookimpl(wrapper=True)  # around pytest-xdist, which names each item's group
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Iterator[None]:
    """Plain `pytest` is the fast tier; slower tiers run when selected with -m."""
    if not config.option.markexpr:
        for item in items:
            for tier in TIERS:
                if tier in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=f"{tier} tier: select with -m {tier}"))
        return (yield)
    heavy = {
        id(i)
        for i in items
        if any(tier in i.keywords for tier in HEAVY) and "beside_heavy" not in i.keywords
    }
    for item in items:
        if id(item) in heavy:
            item.add_marker(pytest.mark.xdist_group("heavy"))
    items.sort(key=lambda i: id(i) not in heavy)  # stable: the heavy group is handed out first
    return (yield)


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=10)


@pytest.fixture
def spawn(peers: list[Peer]):  # type: ignore[no-untyped-def]
    def _spawn(role: str, endpoint: str, *args: str) -> Peer:
        p = start_peer(role, endpoint, *args)
        peers.append(p)
        return p

    return _spawn


@pytest.fixture
def ipc_ep() -> str:
    return ipc_endpoint(f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def steady_gc() -> Iterator[None]:
    """For tests that time heartbeats and timeouts in under a few seconds: the objects
    that exist when the test starts are frozen out of the cyclic collector until it
    ends. A pytest worker that has imported vLLM, Megatron and transformers for earlier
    tests holds millions of objects, and one full collection over them took 1.7-2.6 s
    on CI beside the heavy group (peers declared dead mid-test); the processes these
    tests stand for hold a fraction of that. Unfrozen afterwards: nothing is leaked."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
