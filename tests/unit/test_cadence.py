"""The planning clock shared by the coordinator and the simulator (control/cadence.py)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlix_async.protocols.cadence import (
    PROGRESS_BUCKETS,
    PlanCadence,
    progress_bucket,
    progress_is_urgent,
)


def test_nothing_pending_means_no_plan_due() -> None:
    assert PlanCadence().due() is None


def test_urgent_plans_at_once_progress_waits_for_its_interval() -> None:
    c = PlanCadence(plan_interval_s=0.0, progress_interval_s=5.0)
    c.started(100.0)
    c.finished(100.0, 0.0)
    c.progress()
    assert c.due() == 105.0
    c.urgent()  # an urgent event behind a progress report is not held back by it
    assert c.due() == 100.0
    c.started(101.0)
    assert c.due() is None


def test_plan_interval_and_twice_the_plan_time_of_rest() -> None:
    c = PlanCadence(plan_interval_s=1.0, progress_interval_s=0.0)
    c.started(10.0)
    c.finished(10.5, 0.5)  # took 0.5 s: 1.0 s of rest after it ends
    c.urgent()
    assert c.due() == 11.5
    c2 = PlanCadence(plan_interval_s=3.0)
    c2.started(10.0)
    c2.finished(10.1, 0.1)
    c2.urgent()
    assert c2.due() == 13.0


@given(
    st.lists(st.tuples(st.floats(0, 10), st.booleans(), st.floats(0, 1)), min_size=1, max_size=40),
    st.floats(0, 2),
    st.floats(0, 5),
)
def test_plans_keep_every_spacing_rule_and_no_event_is_lost(
    events: list[tuple[float, bool, float]], interval: float, progress_interval: float
) -> None:
    """Driven like the simulator and the coordinator: events at times, a plan whenever
    one is due, each plan taking ``took``. Every plan starts at least ``interval`` after
    the previous start and ``2 took`` after its end; one that only progress asked for,
    ``progress_interval`` after the previous start; no event is left without a plan."""
    c = PlanCadence(interval, progress_interval)
    starts: list[tuple[float, float, bool]] = []  # (start, took, urgent asked)
    now = last = 0.0
    urgent_pending = False
    for gap, urgent, took in events:
        now += gap
        due = c.due()
        if due is not None and due <= now:  # the plan that was due ran before this event
            at = max(due, last)  # not before the event that asked for it
            c.started(at)
            c.finished(at + took, took)
            starts.append((at, took, urgent_pending))
            urgent_pending = False
        last = now
        c.urgent() if urgent else c.progress()
        urgent_pending |= urgent
        assert c.due() is not None  # remembered until a plan starts
    for (a, took, _), (b, _, urgent_asked) in itertools.pairwise(starts):
        assert b >= a + interval - 1e-9
        assert b >= a + 3 * took - 1e-9  # took to run, then twice that of rest
        if not urgent_asked:
            assert b >= a + max(interval, progress_interval) - 1e-9


def test_the_rebalance_timer_plans_without_events_and_first_at_once() -> None:
    c = PlanCadence(0.0, 5.0, rebalance_s=2.0)
    assert c.due() == -math.inf  # the first plan: now
    c.started(10.0)
    c.finished(10.0, 0.0)
    assert c.due() == 12.0
    c.progress()  # progress alone would wait 5 s: the timer comes first
    assert c.due() == 12.0
    c.finished(10.0, 3.0)  # but never before the rest owed
    assert c.due() == 16.0


@pytest.mark.parametrize(
    ("before", "after", "urgent"),
    [
        (None, (64, 0), True),  # a new stream
        ((64, 10), (128, 10), True),  # a new batch size
        ((64, 64), (64, 0), True),  # the batch after a training step: demand again
        ((64, 63), (64, 64), True),  # no demand any more: its shards can go
        ((64, 10), (64, 12), False),  # a bucket further: progress
        ((64, 64), (64, 64), False),
    ],
)
def test_reports_that_start_or_end_demand_are_urgent(
    before: tuple[int, int] | None, after: tuple[int, int], urgent: bool
) -> None:
    assert progress_is_urgent(before, *after) is urgent


@pytest.mark.parametrize(("target", "done", "bucket"), [(64, 0, 0), (64, 2, 1), (64, 64, 50)])
def test_progress_buckets_are_two_percent(target: int, done: int, bucket: int) -> None:
    assert progress_bucket(target, done) == bucket
    assert progress_bucket(0, 0) == PROGRESS_BUCKETS
