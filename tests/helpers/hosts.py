"""The multinode tier's hosts (``rlix_async/bench/hosts.py``, which the weights
benchmark uses too): where namespaces cannot be made the test fails with the reason,
never a silent skip."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlix_async.bench.hosts import Host, Hosts, HostsError
from rlix_async.bench.hosts import make_hosts as _make_hosts

__all__ = ["Host", "Hosts", "make_hosts"]


@contextlib.contextmanager
def make_hosts(n: int, root: Path) -> Iterator[Hosts]:
    try:
        context = _make_hosts(n, root)
        hosts = context.__enter__()
    except HostsError as exc:
        pytest.fail(
            f"the multinode tier needs {exc}; deselect it with -m 'not multinode' "
            "where they cannot be made",
            pytrace=False,
        )
    try:
        yield hosts
    finally:
        context.__exit__(None, None, None)
