"""Waiting in tests for what another task or process does next."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(pred: Callable[[], object], timeout: float = 10.0) -> None:
    """Return once ``pred()`` is true; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
