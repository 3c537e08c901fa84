"""Test tiers and shared fixtures. ``tests/unit``: pure functions and in-memory objects;
``tests/integration``: real processes, sockets, engines and files; ``tests/helpers``:
what both use (helper processes, the scripted engine)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from helpers.cluster import Peer, start_peer

from rlix_async.security import ipc_endpoint

TIERS = ("slow", "vllm", "gpu", "multinode")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plain `pytest` is the fast tier; slower tiers run when selected with -m."""
    if config.option.markexpr:
        return
    for item in items:
        for tier in TIERS:
            if tier in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{tier} tier: select with -m {tier}"))


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
