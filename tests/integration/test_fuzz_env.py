"""``bench fuzz --target env`` in the suite: a few hundred broken episodes through the
real episode runner and env worker processes (the 10,000-input run is in docs/PERF.md).
The tokenizer is the tiny offline one (helpers/tiny_text.py), saved as a directory.
Slow tier: it keeps both cores busy, and beside the multinode test it starved a shard
worker's heartbeats (declared dead at 2.5 s) in a CI run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tiny_text import tiny_tokenizer

from rlix_async.bench.fuzz import run_fuzz_bench


@pytest.mark.slow  # processes at full tilt: kept off the heavy tests' worker in CI
@pytest.mark.timeout(240)
def test_broken_envs_fail_their_own_episodes_and_the_driver_serves_on(tmp_path: Path) -> None:
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    r = run_fuzz_bench("env", 200, seed=1, model=str(tmp_path / "tok"))
    assert r["problems"] == [] and r["ok"], r
    # the loop's verdicts are in problems: no second of its own CPU in one go, no stall
    # a blocked loop would make (LOOP_BLOCKED_S); how late its timer fired measures the
    # host as much as the driver, so it decides nothing here
    assert r["then_served"] == 20
    assert set(r["kinds"]) == {
        "garbage", "raises", "exits", "dies", "hangs", "unpicklable", "bad_reset",
        "init_raises", "huge", "good",
    }  # fmt: skip
    failed = {k.split(":")[0] for k in r["outcomes"] if "failed" in k}
    assert failed >= set(r["kinds"]) - {"good", "huge"}  # each broken kind failed its episode
    assert r["workers_replaced"] > 0  # a worker that died or hung was replaced
