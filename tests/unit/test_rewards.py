"""Reward functions named by path or built-in, and the runner that scores with them safely."""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlix_async.rollout.rewards import (
    BUILTINS,
    MATH_VERIFY_MISSING,
    Reward,
    RewardError,
    RewardRunner,
    Score,
    exact_match,
    final_answer,
    load_reward,
    math_answer,
    regex_format,
)

USER_REWARDS = """
import asyncio
import inspect

def plain(prompt, response, row, scale=1.0):
    return scale * len(response)

async def coro(prompt, response, row):
    await asyncio.sleep(0)
    return {"score": 0.5, "length": len(response), "bad": float("nan"), "text": "x"}

def two_args(prompt, response):
    return 1.0

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of rewards on sys.path, under a fresh name (imports are cached by name)."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at teardown so that a reward stuck on it in a pool thread returns."""
    event = threading.Event()
    yield event
    event.set()


def runner_for(fn: Any, timeout_s: float = 5.0, **kwargs: Any) -> RewardRunner:
    return RewardRunner(fn, timeout_s=timeout_s, **kwargs)


# --- loading ----------------------------------------------------------------------------------


async def test_module_path_with_reward_args(user_module: str) -> None:
    reward = load_reward(f"{user_module}:plain", {"scale": 2.0})
    assert isinstance(reward, Reward) and not reward.is_async
    assert reward("p", "abc", {}) == 6.0  # called as fn(prompt, response, row), args bound
    runner = runner_for(reward)
    assert await runner.score("p", "abcd", {}) == Score(8.0, {})
    runner.close()


async def test_file_path_async_reward_with_extras(user_file: Path) -> None:
    reward = load_reward(f"{user_file}:coro")
    assert reward.is_async
    runner = runner_for(reward)
    score = await runner.score("p", "abc", {})
    # nan and non-numeric extras are dropped, not failures
    assert score == Score(0.5, {"length": 3.0}) and runner.failures == 0
    runner.close()


@pytest.mark.parametrize(
    ("spec", "args", "message"),
    [
        ("no_such_module_xyz:f", None, "cannot load reward: cannot import no_such_module_xyz"),
        ("/nowhere/rewards.py:f", None, "/nowhere/rewards.py: no such file"),
        ("json:no_such_function", None, "json has no 'no_such_function'"),
        ("{module}:NOT_CALLABLE", None, "is a int, not a function"),
        ("{module}:two_args", None, r"cannot be called as fn\(prompt, response, row\)"),
        ("{module}:plain", {"nope": 1}, r"fn\(prompt, response, row, nope\): .*'nope'"),
        ("unknown_builtin", None, "unknown reward 'unknown_builtin': the built-ins are"),
        ("regex_format", None, "missing a required argument: 'pattern'"),
        ("regex_format", {"pattern": "(unclosed"}, "invalid pattern '\\(unclosed'"),
        ("regex_format", {"pattern": 3}, "pattern must be a string"),
    ],
)
def test_load_errors_are_one_line_reward_errors(
    user_module: str, spec: str, args: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(RewardError, match=message) as caught:
        load_reward(spec.format(module=user_module), args)
    assert "\n" not in str(caught.value)


def test_a_module_failing_at_import_is_a_reward_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="RuntimeError: boom second line") as caught:
        load_reward(f"{name}:f")
    assert "\n" not in str(caught.value)


def test_builtins_by_bare_name() -> None:
    assert set(BUILTINS) == {"math_answer", "exact_match", "regex_format"}
    assert load_reward("exact_match").fn is exact_match
    reward = load_reward("regex_format", {"pattern": r"<a>.*</a>"})
    assert reward("", " <a>x\ny</a> ", {}) == 1.0


# --- running ----------------------------------------------------------------------------------


async def test_a_raising_reward_is_counted_logged_once_and_the_runner_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def flaky(prompt: str, response: str, row: dict[str, Any]) -> float:
        if response == "bad":
            raise ValueError("cannot grade\nthis")
        return 1.0

    runner = runner_for(flaky)
    row = {"answer": "42", "long": "z" * 1000}
    with caplog.at_level(logging.ERROR, logger="rlix_async.rewards"):
        score = await runner.score("p", "bad", row)
        assert score == Score(0.0, {}, "raised ValueError: cannot grade this")
        assert (await runner.score("p", "bad", {"answer": "other"})).failed
    assert runner.failures == 2
    assert runner.first_error is not None
    assert "cannot grade this" in runner.first_error and "'answer': '42'" in runner.first_error
    assert len(runner.first_error) < 500  # the row's repr is truncated
    assert "other" not in runner.first_error  # the first failure is kept
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot grade this" in errors[0].getMessage()
    assert await runner.score("p", "good", {}) == Score(1.0, {})
    runner.close()


async def test_a_reward_calling_exit_is_a_failed_score_not_the_drivers_end() -> None:
    def quits(prompt: str, response: str, row: dict[str, Any]) -> float:
        sys.exit(4)

    async def quits_async(prompt: str, response: str, row: dict[str, Any]) -> float:
        raise SystemExit(5)

    for fn, code in ((quits, 4), (quits_async, 5)):
        runner = runner_for(fn)
        score = await runner.score("p", "r", {})
        assert score.failed and score.error == f"raised CalledExit: called exit({code})"
        runner.close()


async def test_a_sync_reward_that_times_out_fails_within_a_second(
    released: threading.Event,
) -> None:
    def stuck(prompt: str, response: str, row: dict[str, Any]) -> float:
        released.wait(10)
        return 1.0

    runner = runner_for(stuck, timeout_s=0.2)
    started = time.monotonic()
    score = await runner.score("p", "r", {})
    assert time.monotonic() - started < 1.0
    assert score.error == "timed out after 0.2 s" and score.value == 0.0
    assert runner.failures == 1
    started = time.monotonic()
    runner.close()  # does not wait for the stuck call
    assert time.monotonic() - started < 0.5


async def test_an_async_reward_that_times_out_fails_within_a_second() -> None:
    async def slow(prompt: str, response: str, row: dict[str, Any]) -> float:
        await asyncio.sleep(10)
        return 1.0

    runner = runner_for(slow, timeout_s=0.2)
    started = time.monotonic()
    score = await runner.score("p", "r", {})
    assert time.monotonic() - started < 1.0
    assert score.error == "timed out after 0.2 s" and runner.failures == 1
    runner.close()


async def test_a_timeout_error_raised_by_the_reward_is_not_called_a_timeout() -> None:
    def raises_timeout(prompt: str, response: str, row: dict[str, Any]) -> float:
        raise TimeoutError("grader service")

    runner = runner_for(raises_timeout)
    assert (await runner.score("p", "r", {})).error == "raised TimeoutError: grader service"
    runner.close()


@pytest.mark.parametrize(
    ("returned", "error"),
    [
        (float("nan"), "non-finite score nan"),
        (float("inf"), "non-finite score inf"),
        ({"score": float("-inf")}, "non-finite score -inf"),
        ("1.0", "returned str '1.0', not a number"),
        (None, "returned NoneType None, not a number"),
        (1j, "returned complex 1j, not a number"),
        ({"value": 1.0}, "dict without 'score'"),
        ({"score": "high"}, "returned str 'high', not a number"),
    ],
)
async def test_bad_returns_are_counted_failures(returned: Any, error: str) -> None:
    runner = runner_for(lambda prompt, response, row: returned)
    score = await runner.score("p", "r", {})
    assert score.value == 0.0 and score.extras == {} and score.error is not None
    assert error in score.error and runner.failures == 1
    runner.close()


@pytest.mark.parametrize(("returned", "value"), [(1, 1.0), (True, 1.0), (0.25, 0.25)])
async def test_ints_and_bools_are_scores(returned: Any, value: float) -> None:
    runner = runner_for(lambda prompt, response, row: returned)
    assert await runner.score("p", "r", {}) == Score(value, {})
    runner.close()


async def test_a_plain_function_returning_a_coroutine_is_a_failure() -> None:
    async def inner() -> float:
        return 1.0

    made: list[Coroutine[Any, Any, float]] = []

    def wrapped(prompt: str, response: str, row: dict[str, Any]) -> Coroutine[Any, Any, float]:
        made.append(inner())
        return made[-1]

    runner = runner_for(wrapped)
    score = await runner.score("p", "r", {})
    assert score.error is not None and "declare it async def" in score.error
    # closed, so no "coroutine was never awaited" warning follows
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED
    runner.close()


async def test_a_sync_reward_runs_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def slow(prompt: str, response: str, row: dict[str, Any]) -> float:
        seen.append(threading.get_ident())
        time.sleep(0.3)
        return 1.0

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    runner = runner_for(slow)
    ticking = asyncio.create_task(ticker())
    assert (await runner.score("p", "r", {})).value == 1.0
    ticking.cancel()
    assert seen and seen[0] != loop_thread
    assert ticks >= 5  # the loop kept running while the reward slept
    runner.close()


async def test_sync_rewards_run_concurrently_up_to_max_threads() -> None:
    def slow(prompt: str, response: str, row: dict[str, Any]) -> float:
        time.sleep(0.2)
        return 1.0

    runner = runner_for(slow, max_threads=4)
    started = time.monotonic()
    scores = await asyncio.gather(*(runner.score("p", "r", {}) for _ in range(4)))
    assert all(s.value == 1.0 for s in scores)
    assert time.monotonic() - started < 0.6  # 4 x 0.2 s one after the other would be 0.8 s
    runner.close()


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_cancellation_propagates(kind: str, released: threading.Event) -> None:
    async def slow_async(prompt: str, response: str, row: dict[str, Any]) -> float:
        await asyncio.sleep(10)
        return 1.0

    def slow_sync(prompt: str, response: str, row: dict[str, Any]) -> float:
        released.wait(10)
        return 1.0

    runner = runner_for(slow_async if kind == "async" else slow_sync)
    task = asyncio.create_task(runner.score("p", "r", {}))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runner.failures == 0 and runner.first_error is None
    runner.close()


def test_runner_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(exact_match, timeout_s=0)
    with pytest.raises(ValueError, match="max_threads"):
        RewardRunner(exact_match, timeout_s=1, max_threads=0)


# --- built-ins --------------------------------------------------------------------------------

MATH_CASES = [
    ("The answer is 85.", 85, 1.0),
    ("\\boxed{85}", "85", 1.0),
    ("84", 85, 0.0),
    ("85.0", 85, 1.0),
    ("1,234", 1234, 1.0),
    ("The total is 1,234 dollars.", "1234", 1.0),
    ("x = -7", -7, 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("x = -7", 7, 0.0),
    ("first 3, then \\boxed{12}, finally 5", 12, 1.0),  # a boxed answer beats later numbers
    ("\\boxed{3} then \\boxed{12}", 12, 1.0),  # the last box
    ("I think 3 then 85", 85, 1.0),  # the last number
    ("no number here", 85, 0.0),
    ("2.5", 2.5, 1.0),
]


@pytest.fixture(params=["math_verify", "fallback"])
def math_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify fails
    return str(request.param)


@pytest.mark.parametrize(("response", "gold", "expected"), MATH_CASES)
def test_math_answer(math_path: str, response: str, gold: Any, expected: float) -> None:
    assert math_answer("prompt", response, {"answer": gold}) == expected


def test_math_answer_uses_math_verify_when_installed(math_path: str) -> None:
    # only math-verify knows that \frac{1}{2} is 0.5: this tells the two paths apart
    got = math_answer("", "\\boxed{\\frac{1}{2}}", {"answer": "0.5"})
    assert got == (1.0 if math_path == "math_verify" else 0.0)
    # the fallback still compares non-numbers as text
    assert math_answer("", "\\boxed{\\frac{1}{2}}", {"answer": "\\frac{1}{2}"}) == 1.0


def test_loading_math_answer_without_math_verify_says_what_to_install(
    math_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallback is weaker (no \\frac, no sets): loading the reward says so in one
    line naming the extra, once per load, and only when math-verify is missing."""
    with caplog.at_level(logging.WARNING, logger="rlix_async.rewards"):
        load_reward("math_answer")
    warned = [r.getMessage() for r in caplog.records if "math-verify" in r.getMessage()]
    if math_path == "fallback":
        assert warned == [MATH_VERIFY_MISSING] and "rlix_async[recipes]" in warned[0]
    else:
        assert warned == []


def test_math_answer_works_in_a_thread(math_path: str) -> None:
    # math-verify's default timeouts use signal.alarm, which raises off the main thread
    results: list[float] = []
    errors: list[BaseException] = []

    def grade() -> None:
        try:
            results.append(math_answer("", "so \\boxed{85}", {"answer": 85}))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=grade)
    thread.start()
    thread.join(10)
    assert errors == [] and results == [1.0]


def test_math_answer_needs_an_answer_field(math_path: str) -> None:
    with pytest.raises(KeyError, match="math_answer needs an 'answer' field in each row"):
        math_answer("", "85", {"question": "?"})


async def test_a_missing_answer_is_a_counted_failure() -> None:
    runner = runner_for(load_reward("math_answer"))
    score = await runner.score("", "85", {"question": "?"})
    assert score.failed and "needs an 'answer' field" in (score.error or "")
    assert runner.failures == 1
    runner.close()


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("\\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),
        ("\\boxed{unclosed 42", "42"),
        ("from 3-5 pages", "5"),
        ("it is -0.5", "-0.5"),
        ("1,234,567 apples", "1,234,567"),
        ("nothing", None),
    ],
)
def test_final_answer(response: str, expected: str | None) -> None:
    assert final_answer(response) == expected


def test_exact_match() -> None:
    assert exact_match("", "  Paris \n", {"answer": "Paris"}) == 1.0
    assert exact_match("", "paris", {"answer": "Paris"}) == 0.0
    assert exact_match("", "42", {"answer": 42}) == 1.0


def test_regex_format() -> None:
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    assert regex_format("", " <think>a\nb</think>\n<answer>1</answer> ", {}, pattern) == 1.0
    assert regex_format("", "<answer>1</answer>", {}, pattern) == 0.0
    assert regex_format("", "<think>a</think><answer>1</answer> extra", {}, pattern) == 0.0


async def test_runner_accepts_a_callable_with_an_async_call_method() -> None:
    class Grader:
        async def __call__(self, prompt: str, response: str, row: dict[str, Any]) -> float:
            await asyncio.sleep(0)
            return 1.0

    runner = RewardRunner(Grader(), timeout_s=1)
    assert runner.reward.is_async
    assert await runner.score("", "", {}) == Score(1.0, {})
    runner.close()


async def test_a_call_waiting_for_a_thread_is_not_timed_out_by_its_wait() -> None:
    """With one thread, two 0.3 s calls under a 0.5 s timeout both succeed: the second's
    clock starts when a thread runs it (timing the queue would fail it at 0.5 s)."""

    def slow(prompt: str, response: str, row: dict[str, Any]) -> float:
        time.sleep(0.3)
        return 1.0

    runner = RewardRunner(slow, timeout_s=0.5, max_threads=1)
    try:
        scores = await asyncio.gather(*(runner.score("p", "r", {}) for _ in range(2)))
        assert [s.error for s in scores] == [None, None] and runner.failures == 0
    finally:
        runner.close()


async def test_a_timed_out_call_holds_its_thread_until_it_returns() -> None:
    release = threading.Event()

    def stuck(prompt: str, response: str, row: dict[str, Any]) -> float:
        release.wait(5)
        return 1.0

    runner = RewardRunner(stuck, timeout_s=0.1, max_threads=1)
    try:
        first = await runner.score("p", "r", {})
        assert first.error is not None and "timed out" in first.error and runner.stuck == 1
        release.set()
        async with asyncio.timeout(5):
            while runner.stuck:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        release.clear()
        assert (await runner.score("p", "r", {"ok": 1})).error is not None  # times out again
        release.set()
    finally:
        runner.close()
