"""Shared-memory weight segments: names no two pipelines, users or runs can share, and
no segment opened that another user could have written. Real files and mappings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlix_async.weights.shm import (
    Segment,
    ShmSecurityError,
    check_shm_dir,
    pipeline_prefix,
    segment_prefix,
)


def test_names_never_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    # ids that one character-replacing escape would map together, and a prefix of another
    assert pipeline_prefix("a/b") != pipeline_prefix("a_b")
    assert not pipeline_prefix("a-b").startswith(pipeline_prefix("a"))
    assert not segment_prefix("a-b", "rank0").startswith(pipeline_prefix("a"))
    first = pipeline_prefix("p")
    monkeypatch.setenv("RLIX_JOB", "another-run")
    assert pipeline_prefix("p") != first  # two runs on one machine
    assert f"-{os.getuid()}-" in first  # and two users


def test_a_segment_that_is_not_private_is_refused(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    seg = Segment("rlix-test-seg", 4096, create=True, shm_dir=shm)
    seg.close()
    assert Segment("rlix-test-seg", shm_dir=shm).close()  # ours, 0600: opened
    os.chmod(shm / "rlix-test-seg", 0o644)  # e.g. planted by someone, or loosened
    with pytest.raises(ShmSecurityError, match="must be ours and 0600"):
        Segment("rlix-test-seg", shm_dir=shm)
    os.chmod(shm / "rlix-test-seg", 0o600)
    (shm / "rlix-link").symlink_to(shm / "rlix-test-seg")
    with pytest.raises(OSError):  # never follows a link someone put in its place
        Segment("rlix-link", shm_dir=shm)


def test_a_shared_shm_dir_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ShmSecurityError, match="other users could write"):
        check_shm_dir(open_dir)
    with pytest.raises(ShmSecurityError):
        Segment("rlix-x", 4096, create=True, shm_dir=open_dir)
    assert not (open_dir / "rlix-x").exists()
    os.chmod(open_dir, 0o1777)  # sticky, like /dev/shm and /tmp: accepted
    check_shm_dir(open_dir)
    check_shm_dir(Path("/dev/shm"))
