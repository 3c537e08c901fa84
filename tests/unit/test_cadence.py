"""The planning clock shared by the coordinator and the simulator (control/cadence.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlix_async.control.cadence import PROGRESS_BUCKETS, PlanCadence, progress_bucket


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
    st.lists(st.tuples(st.floats(0, 10), st.booleans()), min_size=1, max_size=40),
    st.floats(0, 2),
    st.floats(0, 5),
)
def test_plans_never_closer_than_the_interval_and_no_event_is_lost(
    events: list[tuple[float, bool]], interval: float, progress_interval: float
) -> None:
    """Driven like the simulator: events at times, a plan whenever one is due."""
    c = PlanCadence(interval, progress_interval)
    starts: list[float] = []
    now = last = 0.0
    for gap, urgent in events:
        now += gap
        due = c.due()
        if due is not None and due <= now:  # the plan that was due ran before this event
            at = max(due, last)  # not before the event that asked for it
            c.started(at)
            c.finished(at, 0.0)
            starts.append(at)
        last = now
        c.urgent() if urgent else c.progress()
        due = c.due()
        assert due is not None  # remembered
        limit = interval if urgent else max(interval, progress_interval)
        assert due <= max(now, (starts[-1] if starts else -1e9) + limit) + 1e-9
    assert all(b - a >= interval - 1e-9 for a, b in itertools.pairwise(starts))


@pytest.mark.parametrize(("target", "done", "bucket"), [(64, 0, 0), (64, 2, 1), (64, 64, 50)])
def test_progress_buckets_are_two_percent(target: int, done: int, bucket: int) -> None:
    assert progress_bucket(target, done) == bucket
    assert progress_bucket(0, 0) == PROGRESS_BUCKETS
