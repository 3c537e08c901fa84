"""Every subcommand given bad input, as a real child process: one line on stderr, exit
code 2, no traceback (``--debug`` adds it); and the line between bad input (2) and a
failure or a bug of ours (1), decided in ``rlix_async.cli.explain``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.cluster import ROOT

# (id, argv with {tmp} for the case directory, a fragment of the one line it prints)
CASES = [
    ("coordinator-missing-config", ["coordinator", "--config", "{tmp}/nope.yaml"], "cannot read"),
    ("coordinator-tcp-no-port", ["coordinator", "endpoint=tcp://nohost"], "tcp://HOST:PORT"),
    (
        "coordinator-public-ipc",
        ["coordinator", "endpoint=ipc://{tmp}/public/c.sock"],
        "must be private",
    ),
    (
        "coordinator-no-key-dir",
        ["coordinator", "endpoint=tcp://127.0.0.1:1", "keys={tmp}/nokeys"],
        "does not exist",
    ),
    ("shard-missing-model", ["shard", "pipeline=p", "rank=0", "model={tmp}/nomodel"], "model:"),
    (
        "launch-out-under-a-file",
        ["launch", "examples/pipelines.yaml", "out={tmp}/afile/out"],
        "is not a directory",
    ),
    ("demo-bad-steps", ["demo", "--steps", "0"], "--steps: must be >= 1"),
    ("demo-quick-and-recipe", ["demo", "--quick", "--recipe", "arithmetic"], "one or the other"),
    ("plan-not-json", ["plan", "{tmp}/afile"], "invalid snapshot"),
    (
        "simulate-journal-dir-missing",
        ["simulate", "scenarios/math_rlvr.yaml", "--journal", "{tmp}/nodir/j.jsonl"],
        "does not exist",
    ),
    ("scenario-bad-steps", ["scenario", "agentic", "--steps", "0"], "--steps >= 1"),
    (
        "simulate-bad-staleness",
        ["simulate", "scenarios/math_rlvr.yaml", "--staleness", "-1"],
        "--staleness must be >= 0",
    ),
    ("status-bad-scheme", ["status", "--endpoint", "foo://x"], "unsupported endpoint"),
    (
        "status-public-ipc",
        ["status", "--endpoint", "ipc://{tmp}/public/c.sock"],
        "must be private",
    ),
    ("status-tcp-no-keys", ["status", "--endpoint", "tcp://127.0.0.1:1"], "need CURVE keys"),
    (
        "status-keys-missing",
        ["status", "--endpoint", "tcp://127.0.0.1:1", "--keys", "{tmp}/private"],
        "missing key file",
    ),
    (
        "kill-no-coordinator",
        ["kill", "p", "--endpoint", "ipc://{tmp}/private/none.sock"],
        "no coordinator at",
    ),
    ("timeline-missing-journal", ["timeline", "{tmp}/nope.jsonl"], "cannot read"),
    ("trace-missing-journal", ["trace", "{tmp}/nope.jsonl"], "cannot read"),
    ("trace-empty-journal", ["trace", "{tmp}/empty.jsonl"], "no scheduling events"),
    ("keygen-public-dir", ["keygen", "{tmp}/public"], "must be private"),
    ("config-check-bad-value", ["config", "check", "{tmp}/bad.yaml"], "cluster.nodes"),
    ("bench-bad-arg", ["bench", "plan", "--gpus", "0"], "--gpus: must be >= 1"),
    ("unknown-command", ["nosuch"], "invalid choice"),
]
DEBUG = ["status", "--endpoint", "ipc://{tmp}/public/c.sock", "--debug"]


def _run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    args = [a.replace("{tmp}", str(tmp)) for a in argv]
    return subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def outcomes(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case run once, three at a time (each child mostly waits on imports)."""
    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "public").mkdir(mode=0o755)
    os.chmod(tmp / "public", 0o755)  # mkdir's mode is cut by the umask
    (tmp / "private").mkdir(mode=0o700)
    (tmp / "afile").write_text("not a directory, not a snapshot")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "bad.yaml").write_text("cluster: {nodes: 0}\n")
    runs = {name: argv for name, argv, _ in CASES} | {"debug": DEBUG}
    with ThreadPoolExecutor(3) as pool:
        done = {name: pool.submit(_run, argv, tmp) for name, argv in runs.items()}
        return {name: f.result() for name, f in done.items()}


@pytest.mark.parametrize(
    ("name", "fragment"), [(n, f) for n, _, f in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_one_line_and_exit_2(
    outcomes: dict[str, subprocess.CompletedProcess[str]], name: str, fragment: str
) -> None:
    out = outcomes[name]
    lines = out.stderr.splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in out.stderr
    assert out.stdout == ""  # refused before anything ran


def test_debug_adds_the_traceback_and_keeps_the_exit_code(
    outcomes: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    out = outcomes["debug"]
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("Traceback (most recent call last):"), out.stderr
    assert "SecurityError" in out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: ") and "must be private" in out.stderr


# --- in process: what is bad input and what is not ------------------------------------


def _args(**values: object) -> argparse.Namespace:
    return argparse.Namespace(debug=False, verbose=False, **values)


def test_an_os_error_on_a_path_the_user_named_is_bad_input(tmp_path: Path) -> None:
    from rlix_async.cli import explain

    args = _args(out=str(tmp_path / "out"), overrides=[f"journal={tmp_path}/j/x.jsonl"])
    exc = NotADirectoryError(20, "Not a directory", str(tmp_path / "out" / "sub"))
    assert explain(exc, args) == (2, f"error: {tmp_path}/out/sub: Not a directory")
    exc = FileNotFoundError(2, "No such file or directory", f"{tmp_path}/j/x.jsonl")
    assert explain(exc, args)[0] == 2  # an override's value is the user's too
    # the same error on a file the command line never named is not the user's fault
    elsewhere = FileNotFoundError(2, "No such file or directory", "/usr/share/rlix/x")
    code, line = explain(elsewhere, args)
    assert code == 1 and "FileNotFoundError" in line and "--debug" in line


def test_a_bug_is_an_internal_error_never_bad_input() -> None:
    from rlix_async.cli import explain
    from rlix_async.transport import CallTimeout

    code, line = explain(KeyError("stage"), _args())
    assert (code, line) == (
        1,
        "error: internal error: KeyError: 'stage' (--debug shows where)",
    )
    code, line = explain(ValueError("a\nb"), _args())  # a ValueError is not ConfigError
    assert code == 1 and "internal error" in line and "\n" not in line
    code, line = explain(CallTimeout("no answer from ipc://x within 10 s"), _args())
    assert code == 1 and "internal" not in line and "no answer" in line


def test_main_prints_one_line_and_with_debug_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import rlix_async.cli.observe as observe
    from rlix_async.cli import main

    def broken(args: argparse.Namespace, tool_name: str) -> int:
        return {}["missing"]  # type: ignore[no-any-return]

    monkeypatch.setattr(observe, "_journal_tool", broken)
    assert main(["trace", str(tmp_path / "j.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: internal error: KeyError: 'missing' (--debug shows where)"]
    assert main(["trace", str(tmp_path / "j.jsonl"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err and err.splitlines()[-1].startswith("error:")


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("ipc:///tmp/x.sock", True),
        ("ipc://@abstract", True),
        ("tcp://10.0.0.1:7600", True),
        ("tcp://*:7600", True),
        ("tcp://[::1]:7600", True),
        ("tcp://host", False),
        ("tcp://host:0", False),
        ("tcp://host:65536", False),
        ("tcp://:7600", False),
        ("udp://host:1", False),
        ("ipc://", False),
        ("host:7600", False),
    ],
)
def test_endpoint_forms(endpoint: str, ok: bool) -> None:
    from rlix_async.cli.args import endpoint_problem

    assert (endpoint_problem(endpoint) is None) == ok


def test_check_output(tmp_path: Path) -> None:
    from rlix_async.cli.args import UsageError, check_output

    afile = tmp_path / "afile"
    afile.write_text("")
    check_output(tmp_path / "new" / "deeper", directory=True)  # made with its parents
    check_output(tmp_path / "x.json")
    check_output(tmp_path / "new" / "x.jsonl", parents=True)
    refused: list[tuple[Callable[[], None], str]] = [
        (lambda: check_output(tmp_path / "no" / "x.json"), "does not exist"),
        (lambda: check_output(tmp_path), "is a directory"),
        (lambda: check_output(afile / "sub", directory=True), "is not a directory"),
        (lambda: check_output(afile, directory=True), "not a directory"),
        (lambda: check_output(afile / "x.json", parents=True), "is not a directory"),
    ]
    for call, message in refused:
        with pytest.raises(UsageError, match=message):
            call()
