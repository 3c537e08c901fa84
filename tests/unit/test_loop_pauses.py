"""What keeps the coordinator's loop turns short: the pacer that spreads a plan's
commands and acknowledgements over turns, and the garbage collector's settings
(docs/PERF.md, "Coordinator at cluster scale")."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from rlix_async.aio import TurnPacer


class TurnCounter:
    """Counts turns of the running loop: a callback that schedules itself again with
    ``call_soon`` runs once per turn."""

    def __init__(self) -> None:
        self.turn = 0
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


async def test_no_more_than_per_turn_steps_run_in_one_turn_of_the_loop() -> None:
    pacer, turns = TurnPacer(8), TurnCounter()
    ran: list[tuple[int, int]] = []  # (step, turn it ran in)

    async def step(i: int) -> None:
        await pacer.turn()
        ran.append((i, turns.turn))

    turns.start()
    await asyncio.gather(*(step(i) for i in range(100)))
    turns.stop()
    per_turn: dict[int, int] = {}
    for _, t in ran:
        per_turn[t] = per_turn.get(t, 0) + 1
    assert max(per_turn.values()) == 8
    assert len(per_turn) >= 100 // 8
    assert [i for i, _ in ran] == list(range(100))  # first come, first served
    assert pacer.waited == 100 - 8


async def test_a_step_under_the_budget_does_not_wait() -> None:
    pacer = TurnPacer(4)
    for _ in range(4):  # all in one turn: no await gives the loop a turn
        await pacer.turn()
    assert pacer.waited == 0
    await pacer.turn()
    assert pacer.waited == 1


async def test_a_cancelled_waiter_takes_no_budget_and_the_others_go_on() -> None:
    pacer = TurnPacer(1)
    steps = [asyncio.ensure_future(pacer.turn()) for _ in range(3)]
    await asyncio.sleep(0)  # the three ran: the first passed, the other two wait
    assert steps[0].done() and pacer.waited == 2
    steps[1].cancel()
    async with asyncio.timeout(1):  # (a refill that tripped on it would release nobody)
        await steps[2]
    assert steps[1].cancelled()


def test_a_pacer_needs_a_budget() -> None:
    with pytest.raises(ValueError, match="per_turn"):
        TurnPacer(0)


def test_the_coordinator_freezes_its_startup_heap_and_collects_fully_less_often() -> None:
    """In a process of its own: freezing the heap is for the life of the process."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gc\n"
            "from rlix_async.coordinator_main import FULL_GC_EVERY, quiet_gc\n"
            "before = gc.get_threshold()\n"
            "quiet_gc()\n"
            "import sys\n"
            "print(gc.get_freeze_count() > 1000, before[:2] == gc.get_threshold()[:2],"
            # (3.14's incremental collector has no third threshold to set)
            " gc.get_threshold()[2] == FULL_GC_EVERY > before[2] or sys.version_info >= (3, 14))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["True", "True", "True"]
