"""User code by path: 'package.module:Name' or 'path/to/file.py:Name'."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlix_async.user_code import LoadError, load_object


def test_module_and_file_paths(tmp_path: Path) -> None:
    assert load_object("json:dumps")([1]) == "[1]"
    assert load_object("os.path:join")("a", "b") == "a/b"
    mine = tmp_path / "my_engine.py"
    mine.write_text("class Engine:\n    class Inner:\n        x = 7\n")
    cls = load_object(f"{mine}:Engine")
    assert cls.__name__ == "Engine" and load_object(f"{mine}:Engine.Inner").x == 7
    assert load_object(f"{mine}:Engine") is cls  # a file is imported once


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'package.module:name'"),
        ("json:", "expected 'package.module:name'"),
        ("not_a_module_xyz:f", "cannot import not_a_module_xyz"),
        ("json:nothing_here", "json has no 'nothing_here'"),
        ("/nowhere/x.py:f", "/nowhere/x.py: no such file"),
    ],
)
def test_errors_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(LoadError, match=message):
        load_object(spec)


def test_a_file_that_fails_to_import_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(LoadError, match=r"broken.py: failed to import: RuntimeError: boom"):
        load_object(f"{bad}:X")
