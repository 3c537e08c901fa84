"""docs/ARCHITECTURE.md is the map of the code as it is: every file or folder it names
exists (a renamed or removed module fails here until the map follows it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `path/to/file.py`, `room/`, `file.py::Name`: a path from the repository or the package
PATH = re.compile(r"^[\w.\-/]+(?:\.(?:py|md|yaml|sbatch|toml|json)|/)$")


def named_paths(text: str) -> list[str]:
    """The repository paths a document names in backticks (run outputs such as
    ``OUT/<id>/...`` and placeholders are not paths of the repository)."""
    found = []
    for token in re.findall(r"`([^`\s]+)`", text):
        path = token.split("::")[0]
        if (PATH.match(path) and "OUT/" not in path and "/" in path) or path.endswith(".py"):
            found.append(path)
    return found


def test_every_path_the_architecture_names_exists() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = named_paths(text)
    assert len(paths) > 100  # the map names the code it describes
    missing = sorted(
        {p for p in paths if not any((base / p).exists() for base in (ROOT, ROOT / "rlix_async"))}
    )
    assert missing == []


def test_the_path_reader_sees_a_missing_file() -> None:
    assert named_paths("see `shards/gone.py` and `OUT/<id>/ckpt` and `a.b:C`") == ["shards/gone.py"]
