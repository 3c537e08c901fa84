"""Prompt datasets for text recipes: rows from a file, rendered into token ids.

``read_rows`` reads a ``.jsonl``, ``.json`` or ``.parquet`` file, or a directory
written by ``datasets.Dataset.save_to_disk``, and checks that every row carries
the prompt (a string under ``prompt_key``) or the conversation (a list of
``{"role", "content"}`` messages under ``messages_key``). Rows keep all their
other fields: the reward function gets them (the reference answer, say).

``render`` turns one row into the text the model sees, through the tokenizer's
chat template when it has one, and its token ids. ``PromptDataset`` renders a
whole file up front, so a bad row or an oversized prompt shows before any GPU
time is spent, and ``PromptOrder`` says which prompt comes next: every row once
per epoch, in an order fixed by the seed and the epoch alone, so a resumed run
draws the same prompts an uninterrupted one would.

Errors are ``DataError``, one line naming the file and the line or row.
``datasets`` and ``pyarrow`` are imported only when a file needs them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INSTALL_HINT = "pip install 'rlix_async[recipes]'"
FORMATS = ".jsonl, .json, .parquet, or a directory written by datasets' save_to_disk"
NO_CHAT_TEMPLATE = "the tokenizer has no chat template to render 'messages' with"
# Rows tokenized per call: the fast tokenizer encodes a batch on several threads.
TOKENIZE_BATCH = 1024


class DataError(ValueError):
    """Bad data: one line naming the file (and line or row where known)."""


@dataclass(frozen=True)
class Prompt:
    index: int  # row number in the file (0-based)
    ids: list[int]  # token ids of the rendered prompt
    text: str  # the rendered prompt (what the model sees)
    row: dict[str, Any]  # the row without its prompt/messages key: goes to the reward
    value: Any = None  # what the row held under that key (an environment gets the whole row)


def read_rows(
    path: str | Path, *, prompt_key: str | None = None, messages_key: str | None = None
) -> list[dict[str, Any]]:
    """Every row of a data file, each checked to carry the prompt or messages key."""
    key, is_messages = _which_key(prompt_key, messages_key)
    file = Path(path)
    if not file.exists():
        raise DataError(f"{path}: no such file or directory")
    located: list[tuple[str, Any]]  # (where, row) with where = "PATH:LINE" or "PATH: row I"
    if file.is_dir():
        located = _numbered(path, _read_saved_dataset(path))
    elif file.suffix == ".jsonl":
        located = _read_jsonl(path)
    elif file.suffix == ".json":
        located = _numbered(path, _read_json(path))
    elif file.suffix == ".parquet":
        located = _numbered(path, _read_parquet(path))
    else:
        raise DataError(f"{path}: unknown data format {file.suffix or '(no suffix)'!r}: {FORMATS}")
    if not located:
        raise DataError(f"{path}: no rows")
    for where, row in located:
        _check_row(where, row, key, is_messages)
    return [row for _, row in located]


def render(
    row: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str | None = None,
    messages_key: str | None = None,
) -> tuple[str, list[int]]:
    """The text the model sees for ``row`` and its token ids."""
    text = _render_text(row, tokenizer, prompt_key, messages_key)
    ids = tokenizer(text, add_special_tokens=_adds_special_tokens(tokenizer))["input_ids"]
    return text, list(ids)


class PromptDataset:
    """Every row of a data file, rendered, less those longer than ``max_prompt_tokens``."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str | None = None,
        messages_key: str | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        key, is_messages = _which_key(prompt_key, messages_key)
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens}: expected at least 1")
        self.path = str(path)
        self.key = key
        if is_messages and not _has_chat_template(tokenizer):
            # Said once for the file rather than for its first row.
            raise DataError(f"{path}: {NO_CHAT_TEMPLATE}")
        rows = read_rows(path, prompt_key=prompt_key, messages_key=messages_key)
        texts: list[str] = []
        for index, row in enumerate(rows):
            try:
                texts.append(_render_text(row, tokenizer, prompt_key, messages_key))
            except DataError as exc:
                raise DataError(f"{path}: row {index}: {exc}") from None
        all_ids = _tokenize(tokenizer, texts, _adds_special_tokens(tokenizer))
        self.prompts: list[Prompt] = []
        self.skipped = 0
        for index, (row, text, ids) in enumerate(zip(rows, texts, all_ids, strict=True)):
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                self.skipped += 1
                continue
            rest = {field: value for field, value in row.items() if field != key}
            self.prompts.append(Prompt(index=index, ids=ids, text=text, row=rest, value=row[key]))
        if not self.prompts:
            raise DataError(
                f"{path}: all {len(rows)} rows exceed max_prompt_tokens={max_prompt_tokens}"
            )

    def __len__(self) -> int:
        return len(self.prompts)


class PromptOrder:
    """Which prompt comes next: every row once per epoch, in an order that depends only on
    (seed, epoch)."""

    def __init__(self, n: int, seed: int, *, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError(f"n={n}: a prompt order needs at least one prompt")
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # prompts of this epoch already handed out
        self._order = self._order_of(0)

    def next(self) -> int:
        """The index of the next prompt; starts a new epoch when this one is used up."""
        if self.position == self.n:
            self.epoch += 1
            self.position = 0
            self._order = self._order_of(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "n": self.n,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        # A different dataset size, seed or shuffle would give other orders: resuming
        # would silently repeat or skip prompts, so it is refused.
        saved = (state["n"], state["seed"], bool(state["shuffle"]))
        if saved != (self.n, self.seed, self.shuffle):
            raise ValueError(
                f"prompt order state is for n={saved[0]}, seed={saved[1]}, shuffle={saved[2]};"
                f" this order has n={self.n}, seed={self.seed}, shuffle={self.shuffle}"
            )
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position <= self.n:
            raise ValueError(f"prompt order state: epoch={epoch}, position={position} out of range")
        self.epoch = epoch
        self.position = position
        self._order = self._order_of(epoch)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            # A string seed is hashed with SHA-512: the same on every machine and
            # process, and no other RNG's draws move it.
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order


def _which_key(prompt_key: str | None, messages_key: str | None) -> tuple[str, bool]:
    """The row key holding the prompt, and whether it holds messages."""
    if (prompt_key is None) == (messages_key is None):
        raise ValueError("give exactly one of prompt_key and messages_key")
    if messages_key is not None:
        return messages_key, True
    assert prompt_key is not None
    return prompt_key, False


def _numbered(path: str | Path, rows: list[Any]) -> list[tuple[str, Any]]:
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_text(path: str | Path) -> str:
    try:
        # utf-8-sig: files saved by some Windows tools start with a byte-order mark.
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _read_jsonl(path: str | Path) -> list[tuple[str, Any]]:
    located = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not JSON ({exc.msg}, column {exc.colno})") from None
        located.append((f"{path}:{lineno}", row))
    return located


def _read_json(path: str | Path) -> list[Any]:
    try:
        rows = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}: not JSON ({exc.msg}, line {exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(rows, list):
        raise DataError(
            f"{path}: expected a JSON list of objects, got {type(rows).__name__}"
            " (a file of one object per line is .jsonl)"
        )
    return rows


def _read_parquet(path: str | Path) -> list[Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: {INSTALL_HINT}") from None
    try:
        rows: list[Any] = pq.read_table(path).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable parquet file ({_one_line(exc)})") from None
    return rows


def _read_saved_dataset(path: str | Path) -> list[Any]:
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        raise DataError(
            f"{path}: reading a dataset directory needs datasets: {INSTALL_HINT}"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise DataError(
            f"{path}: not a dataset written by save_to_disk ({_one_line(exc)})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        example = Path(path) / splits[0] if splits else Path(path) / "train"
        raise DataError(
            f"{path}: a DatasetDict with splits {', '.join(splits) or '(none)'};"
            f" point data at one split's directory, e.g. {example}"
        )
    return list(loaded)


def _check_row(where: str, row: Any, key: str, is_messages: bool) -> None:
    """Raise DataError unless ``row`` is an object carrying the prompt or messages."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: not an object")
    if key not in row:
        raise DataError(f"{where}: row has no {key!r} (keys: {', '.join(map(str, row)) or 'none'})")
    value = row[key]
    if not is_messages:
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: {key!r} is not a non-empty string")
        return
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} is not a non-empty list of messages")
    for j, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"{where}: {key!r}[{j}] is not a message with string 'role' and 'content'"
            )


def _has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render_text(
    row: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    prompt_key: str | None,
    messages_key: str | None,
) -> str:
    """The rendered prompt: what the model sees."""
    key, is_messages = _which_key(prompt_key, messages_key)
    if not _has_chat_template(tokenizer):
        if is_messages:
            raise DataError(NO_CHAT_TEMPLATE)
        prompt: str = row[key]
        return prompt
    messages = row[key] if is_messages else [{"role": "user", "content": row[key]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja raises its own kinds, and templates may raise anything
        raise DataError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from None
    if not isinstance(text, str):
        raise DataError(f"chat template gave {type(text).__name__}, expected text")
    return text


def _adds_special_tokens(tokenizer: PreTrainedTokenizerBase) -> bool:
    # A chat template already holds BOS and the like: adding special tokens would
    # double them. A plain prompt gets the tokenizer's BOS, if it has one.
    return not _has_chat_template(tokenizer)


def _tokenize(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], add_special_tokens: bool
) -> list[list[int]]:
    """Token ids of every text, encoded in batches."""
    ids: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = texts[start : start + TOKENIZE_BATCH]
        encoded = tokenizer(batch, add_special_tokens=add_special_tokens)["input_ids"]
        ids.extend(list(row_ids) for row_ids in encoded)
    return ids


def write_splits(
    out: Path, train: Iterable[dict[str, Any]], held_out: Iterable[dict[str, Any]]
) -> tuple[Path, Path]:
    """``out/train.jsonl`` and ``out/eval.jsonl``, one JSON row a line; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, rows in zip(paths, (train, held_out), strict=True):
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        tmp.replace(path)  # a reader never sees half a file
    return paths
