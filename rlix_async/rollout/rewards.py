"""Reward functions named in a pipeline config, and a runner that scores with them safely.

A config names its reward as ``reward: "package.module:function"``, ``"path/to/file.py:function"``
or a built-in by bare name (``math_answer``, ``exact_match``, ``regex_format``), with optional
``reward_args: {...}`` passed as keyword arguments. The function is called as
``function(prompt, response, row, **reward_args)``: the rendered prompt text, the response text
and the dataset row's other fields. It may be plain or ``async def`` and returns a number, or a
dict with a numeric ``score`` plus named numeric extras (logged as per-step means).

``load_reward`` checks all of this once, at load time, and raises ``RewardError`` (one line) for
a reward that cannot be used. ``RewardRunner.score`` then never raises for a bad reward at run
time: an exception, a timeout or a bad return value becomes a failed ``Score`` (value 0.0) that
is counted, and the first one is logged with its row. Plain functions run in the runner's own
threads, never on the event loop, so a slow verifier cannot stall the loop's heartbeats.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlix_async.rollout.threads import BoundedThreads
from rlix_async.user_code import LoadError, await_guarded, call_guarded, load_object

logger = logging.getLogger("rlix_async.rewards")

RewardFn = Callable[..., Any]

ROW_REPR_LIMIT = 300
ERROR_TEXT_LIMIT = 500


class RewardError(ValueError):
    """A reward that cannot be used (does not import, wrong signature): a config error, one line."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward: call it as ``reward(prompt, response, row)``.

    A dataclass rather than a ``functools.partial`` so that whether the function is a
    coroutine function, and the name it was given in the config, travel with it for the
    runner and its log lines.
    """

    fn: RewardFn  # the user's function, without reward_args bound
    args: Mapping[str, Any] = field(default_factory=dict)  # reward_args, passed as keywords
    is_async: bool = False
    name: str = ""  # the spec it was loaded from

    def __call__(self, prompt: str, response: str, row: dict[str, Any]) -> Any:
        return self.fn(prompt, response, row, **self.args)


@dataclass(frozen=True)
class Score:
    """One response's reward. A failed score has value 0.0 and says why in ``error``."""

    value: float  # 0.0 when failed
    extras: dict[str, float]
    error: str | None = None  # why it failed (raised / timed out / non-finite / bad return)

    @property
    def failed(self) -> bool:
        return self.error is not None


# ---------------------------------------------------------------------------------------------
# Built-in rewards


def math_answer(prompt: str, response: str, row: dict[str, Any]) -> float:
    """1.0 if the response's final answer equals ``row["answer"]``, else 0.0.

    The final answer is the content of the response's last ``\\boxed{...}``, else its last
    number (``-``, ``,`` thousands separators and decimals allowed). With ``math-verify``
    installed the answer and the gold are compared as math (``\\frac{1}{2}`` equals ``0.5``);
    without it they are compared as numbers, or as text when either is not a number.
    """
    gold = _gold_answer(row, "math_answer")
    answer = final_answer(response)
    if answer is None:
        return 0.0
    math_verify = _math_verify()
    if math_verify is None:
        return 1.0 if answers_equal(answer, gold) else 0.0
    # math-verify's default timeouts use signal.alarm, which raises off the main thread; the
    # runner runs rewards in threads and bounds them itself, so both timeouts are disabled.
    gold_parsed = math_verify.parse(str(gold), parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"math_answer: cannot parse the row's answer {gold!r}")
    answer_parsed = math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    return 1.0 if math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None) else 0.0


def exact_match(prompt: str, response: str, row: dict[str, Any]) -> float:
    """1.0 if the response, stripped, equals ``str(row["answer"])`` stripped, else 0.0."""
    gold = _gold_answer(row, "exact_match")
    return 1.0 if response.strip() == str(gold).strip() else 0.0


def regex_format(prompt: str, response: str, row: dict[str, Any], pattern: str) -> float:
    """1.0 if the whole stripped response matches ``pattern`` (``re.DOTALL``), else 0.0.

    ``pattern`` comes from ``reward_args``; ``load_reward`` refuses a missing or invalid one.
    """
    return 1.0 if re.fullmatch(pattern, response.strip(), re.DOTALL) else 0.0


BUILTINS: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "exact_match": exact_match,
    "regex_format": regex_format,
}

_BOXED = "\\boxed{"
# A minus sign only where it cannot be a subtraction ("3-5" ends in 5, not -5).
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def final_answer(response: str) -> str | None:
    """The content of the last balanced ``\\boxed{...}``, else the last number, else None."""
    start = response.rfind(_BOXED)
    while start != -1:
        content = _braced(response, start + len(_BOXED))
        if content is not None and content.strip():
            return content.strip()
        start = response.rfind(_BOXED, 0, start)
    numbers_found = _NUMBER.findall(response)
    return numbers_found[-1] if numbers_found else None


def _braced(text: str, begin: int) -> str | None:
    """Text from ``begin`` up to the brace that closes the one just before it, or None."""
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def _gold_answer(row: Mapping[str, Any], reward: str) -> Any:
    try:
        return row["answer"]
    except KeyError:
        raise KeyError(f"{reward} needs an 'answer' field in each row") from None


MATH_VERIFY_MISSING = (
    "reward math_answer: math-verify is not installed, so answers are compared as plain "
    "numbers or text (\\frac{1}{2} is not 0.5): pip install 'rlix_async[recipes]'"
)


def _math_verify() -> Any:
    """The math_verify module, or None when it is not installed (then the plain fallback)."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    text = str(value).strip().strip("$").replace(" ", "")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def answers_equal(answer: str, gold: Any) -> bool:
    """Numeric comparison when both are numbers, else whitespace-insensitive text equality."""
    answer_number, gold_number = _as_number(answer), _as_number(gold)
    if answer_number is not None and gold_number is not None:
        return math.isclose(answer_number, gold_number, rel_tol=1e-9, abs_tol=1e-9)

    def normalized(text: str) -> str:
        return "".join(text.strip().strip("$").split())

    return normalized(answer) == normalized(str(gold))


# ---------------------------------------------------------------------------------------------
# Loading


def load_reward(spec: str, reward_args: Mapping[str, Any] | None = None) -> Reward:
    """The reward ``spec`` names, checked to be callable as ``fn(prompt, response, row,
    **reward_args)``; RewardError (one line) when it cannot be used.

    ``spec`` is a built-in's bare name or ``package.module:function`` /
    ``path/to/file.py:function`` (see ``rlix_async.user_code``).
    """
    args = dict(reward_args or {})
    if ":" not in spec:
        if spec not in BUILTINS:
            raise RewardError(
                f"unknown reward {spec!r}: the built-ins are {', '.join(BUILTINS)}; "
                "name your own as 'package.module:function' or 'path/to/file.py:function'"
            )
        fn = BUILTINS[spec]
    else:
        try:
            fn = load_object(spec)
        except LoadError as exc:
            raise RewardError(f"cannot load reward: {_one_line(str(exc))}") from None
        except Exception as exc:  # a module that fails while importing: still a config error
            raise RewardError(
                f"cannot load reward {spec!r}: {type(exc).__name__}: {_one_line(str(exc))}"
            ) from None
        if not callable(fn):
            raise RewardError(f"reward {spec!r} is a {type(fn).__name__}, not a function")
    _check_signature(spec, fn, args)
    if fn is regex_format:
        _check_pattern(spec, args["pattern"])
    if fn is math_answer and _math_verify() is None:  # (imports sympy now, not mid-call)
        logger.warning(MATH_VERIFY_MISSING)
    return Reward(fn=fn, args=args, is_async=_is_async(fn), name=spec)


def _check_signature(spec: str, fn: RewardFn, args: Mapping[str, Any]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some C callables have no signature to check; they fail at run time instead
    try:
        signature.bind("", "", {}, **args)
    except TypeError as exc:
        named = f", {', '.join(args)}" if args else ""
        raise RewardError(
            f"reward {spec!r}: cannot be called as fn(prompt, response, row{named}): {exc}"
        ) from None


def _check_pattern(spec: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise RewardError(f"reward {spec!r}: pattern must be a string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise RewardError(f"reward {spec!r}: invalid pattern {pattern!r}: {exc}") from None


def _is_async(fn: RewardFn) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    # an object whose __call__ is async def
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


# ---------------------------------------------------------------------------------------------
# Running


class RewardRunner:
    """Scores responses with one reward, under a timeout, never raising for a bad reward.

    ``async def`` rewards are awaited on the loop under ``asyncio.timeout``. Plain ones run in
    this runner's own thread pool (``max_threads``) so that a slow verifier never blocks the
    event loop, and are awaited under the same timeout. A thread cannot be killed: a plain
    reward that times out gives a failed Score at once, but the call keeps its thread until it
    returns, so ``max_threads`` calls stuck for good leave later calls queued until they too
    time out. ``close`` does not wait for them; note that Python still joins pool threads at
    interpreter exit, so a call stuck forever delays the process's exit.

    Every failure (exception, timeout, non-finite or non-numeric return, a dict without a
    numeric ``score``) counts in ``failures``; the first is kept in ``first_error`` with its row
    and logged once at ERROR. Cancellation of ``score`` propagates.
    """

    def __init__(self, reward: Reward | RewardFn, *, timeout_s: float, max_threads: int = 4):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if not isinstance(reward, Reward):
            name = getattr(reward, "__qualname__", None) or type(reward).__name__
            reward = Reward(fn=reward, is_async=_is_async(reward), name=name)
        self.reward = reward
        self.timeout_s = timeout_s
        self.failures = 0
        self.first_error: str | None = None
        self._threads = BoundedThreads(max_threads, "reward")
        self.max_threads = max_threads

    @property
    def stuck(self) -> int:
        """Calls that timed out and still hold their thread."""
        return self._threads.stuck

    async def _in_thread(self, prompt: str, response: str, row: dict[str, Any]) -> Any:
        # a free thread: bounded, since timed-out calls may hold every one forever
        future = await self._threads.start(
            call_guarded, self.reward, prompt, response, row, wait_s=self.timeout_s * 10
        )
        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                return await asyncio.wrap_future(future)
        except TimeoutError:
            if not deadline.expired():
                raise  # the reward's own TimeoutError
            raise _TimedOut from None
        finally:
            self._threads.let_go(future)

    async def score(self, prompt: str, response: str, row: dict[str, Any]) -> Score:
        """The response's Score; a failed one (counted) when the reward misbehaves."""
        try:
            if self.reward.is_async:
                try:
                    async with asyncio.timeout(self.timeout_s) as deadline:
                        result = await await_guarded(self.reward(prompt, response, row))
                except TimeoutError:
                    if deadline.expired():
                        raise _TimedOut from None
                    raise
            else:
                result = await self._in_thread(prompt, response, row)
        except _TimedOut:
            return self._fail(f"timed out after {self.timeout_s:g} s", row)
        except Exception as exc:
            return self._fail(_raised(exc), row)
        value, extras, error = _read_result(result)
        if error is not None:
            return self._fail(error, row)
        return Score(value=value, extras=extras)

    def close(self) -> None:
        """Shut the thread pool down without waiting for calls still running."""
        self._threads.close()

    def _fail(self, error: str, row: dict[str, Any]) -> Score:
        self.failures += 1
        if self.first_error is None:
            row_text = repr(row)
            if len(row_text) > ROW_REPR_LIMIT:
                row_text = row_text[:ROW_REPR_LIMIT] + "..."
            self.first_error = f"reward {self.reward.name!r} failed: {error}; row: {row_text}"
            logger.error("%s (later failures are counted, not logged)", self.first_error)
        else:
            logger.debug("reward %r failed: %s", self.reward.name, error)
        return Score(value=0.0, extras={}, error=error)


class _TimedOut(Exception):
    """Our timeout fired (not a TimeoutError the reward raised itself)."""


def _read_result(result: Any) -> tuple[float, dict[str, float], str | None]:
    """(value, extras, error) from what a reward returned; error is None when it is usable."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited: close it so no "never awaited" warning follows
        return 0.0, {}, "returned an awaitable from a plain function: declare it async def"
    extras: dict[str, float] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            return (
                0.0,
                {},
                f"returned a dict without 'score' (keys: {_one_line(str(list(result)))})",
            )
        for key, extra in result.items():
            number = _finite(extra)
            if key != "score" and isinstance(key, str) and number is not None:
                extras[key] = number  # extras that are not finite numbers are dropped
        result = result["score"]
    if not isinstance(result, numbers.Real):
        return 0.0, {}, f"returned {type(result).__name__} {_one_line(repr(result))}, not a number"
    value = float(result)
    if not math.isfinite(value):
        return 0.0, {}, f"returned a non-finite score {value}"
    return value, extras, None


def _finite(value: Any) -> float | None:
    if not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _raised(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {_one_line(str(exc))}"


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_TEXT_LIMIT else text[:ERROR_TEXT_LIMIT] + "..."
