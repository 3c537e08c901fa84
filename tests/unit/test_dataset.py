"""Prompt datasets: reading each file format, the errors that name file and line, rendering
through the chat template, length filtering, and the seeded per-epoch prompt order. Real
files in tmp_path and the offline tiny tokenizer; no model hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.tiny_text import save_tiny_model, tiny_tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from rlix_async.rollout.dataset import (
    DataError,
    PromptDataset,
    PromptOrder,
    read_rows,
    render,
)

ROWS = [
    {"prompt": "What is 3 + 4? Answer with just the number.", "answer": "7", "level": 1},
    {"prompt": "What is 10 + 25? Answer with just the number.", "answer": "35", "level": 2},
]
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 2?"},
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture
def plain_tokenizer() -> PreTrainedTokenizerFast:
    """No chat template, and a BOS (<|endoftext|>) added when special tokens are asked for:
    tells apart tokenizing with and without add_special_tokens."""
    plain = tiny_tokenizer()
    plain.chat_template = None
    plain.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", plain.pad_token_id)]
    )
    return plain


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def message(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text, f"error is not one line: {text!r}"
    return text


# --- formats -----------------------------------------------------------------------------


def test_jsonl_reads_every_row_skips_blank_lines_and_keeps_all_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "", "  ", json.dumps(ROWS[1])])
    assert read_rows(path, prompt_key="prompt") == ROWS


def test_json_list_of_objects(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS), encoding="utf-8")
    assert read_rows(str(path), prompt_key="prompt") == ROWS


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_rows(path, prompt_key="prompt") == ROWS


def test_saved_dataset_directory(tmp_path: Path) -> None:
    directory = tmp_path / "train"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(directory))
    assert read_rows(directory, prompt_key="prompt") == ROWS


def test_dataset_dict_directory_is_refused_naming_its_splits(tmp_path: Path) -> None:
    directory = tmp_path / "dd"
    split = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(directory))
    with pytest.raises(DataError) as exc:
        read_rows(directory, prompt_key="prompt")
    text = message(exc)
    assert "train, test" in text and str(directory / "train") in text


def test_messages_rows(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "m.jsonl", [json.dumps({"messages": CONVERSATION, "answer": "4"})]
    )
    assert read_rows(path, messages_key="messages") == [{"messages": CONVERSATION, "answer": "4"}]


def test_byte_order_mark_is_not_part_of_the_first_row(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n", encoding="utf-8-sig")
    assert read_rows(path, prompt_key="prompt") == [ROWS[0]]


@pytest.mark.parametrize("keys", [{}, {"prompt_key": "prompt", "messages_key": "messages"}])
def test_exactly_one_key(tmp_path: Path, keys: dict[str, str]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0])])
    with pytest.raises(ValueError, match="exactly one"):
        read_rows(path, **keys)


# --- errors ------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}: no such file or directory"


def test_bad_json_line_names_its_line_number(tmp_path: Path) -> None:
    # The blank line counts: the number is the line in the file, not the row.
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "", "{not json"])
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc).startswith(f"{path}:3: not JSON (")


def test_jsonl_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "[1, 2]"])
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}:2: not an object"


def test_row_without_the_key_names_its_line_and_keys(tmp_path: Path) -> None:
    lines = [json.dumps(ROWS[0]), json.dumps({"question": "2 + 2?", "answer": "4"})]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}:2: row has no 'prompt' (keys: question, answer)"


@pytest.mark.parametrize("prompt", [42, None, "", "   ", ["What is 1 + 1?"]])
def test_prompt_that_is_not_a_non_empty_string(tmp_path: Path, prompt: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), json.dumps({"prompt": prompt})])
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}:2: 'prompt' is not a non-empty string"


def test_errors_outside_jsonl_name_the_row(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([ROWS[0], {**ROWS[1], "prompt": ""}]), path)
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}: row 1: 'prompt' is not a non-empty string"


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]],
)
def test_messages_that_are_not_a_list_of_messages(tmp_path: Path, messages: Any) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"messages": messages})])
    with pytest.raises(DataError) as exc:
        read_rows(path, messages_key="messages")
    assert message(exc).startswith(f"{path}:1: 'messages")


def test_json_that_is_not_a_list_or_has_a_non_object_row(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS[0]), encoding="utf-8")
    with pytest.raises(DataError, match="expected a JSON list of objects") as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc).startswith(f"{path}: ")
    path.write_text(json.dumps([ROWS[0], "text"]), encoding="utf-8")
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}: row 1: not an object"


@pytest.mark.parametrize(("name", "content"), [("e.jsonl", "\n\n"), ("e.json", "[]")])
def test_empty_file(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc) == f"{path}: no rows"


def test_unknown_suffix_names_the_accepted_forms(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("prompt\nhi\n", encoding="utf-8")
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    text = message(exc)
    assert text.startswith(f"{path}: unknown data format '.csv'")
    assert all(form in text for form in (".jsonl", ".json", ".parquet", "save_to_disk"))


def test_unreadable_parquet_and_dataset_directory(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as exc:
        read_rows(path, prompt_key="prompt")
    assert message(exc).startswith(f"{path}: not a readable parquet file (")
    directory = tmp_path / "not_a_dataset"
    directory.mkdir()
    with pytest.raises(DataError) as exc:
        read_rows(directory, prompt_key="prompt")
    assert message(exc).startswith(f"{directory}: not a dataset written by save_to_disk (")


# --- rendering ---------------------------------------------------------------------------


def test_render_prompt_through_the_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    text, ids = render(ROWS[0], tokenizer, prompt_key="prompt")
    assert text == (
        "<|im_start|>user\nWhat is 3 + 4? Answer with just the number.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids


def test_render_adds_no_special_tokens_to_a_templated_prompt(
    plain_tokenizer: PreTrainedTokenizerFast,
) -> None:
    # The same tokenizer that adds a BOS, with a template again: the template's text is whole.
    plain_tokenizer.chat_template = tiny_tokenizer().chat_template
    text, ids = render(ROWS[0], plain_tokenizer, prompt_key="prompt")
    assert ids == plain_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] != plain_tokenizer.pad_token_id


def test_render_messages_with_a_system_message(tokenizer: PreTrainedTokenizerFast) -> None:
    text, ids = render({"messages": CONVERSATION}, tokenizer, messages_key="messages")
    assert text == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_render_without_chat_template_uses_the_prompt_as_is(
    tmp_path: Path, plain_tokenizer: PreTrainedTokenizerFast
) -> None:
    text, ids = render(ROWS[0], plain_tokenizer, prompt_key="prompt")
    assert text == ROWS[0]["prompt"]
    assert ids == plain_tokenizer(text)["input_ids"]
    assert ids[0] == plain_tokenizer.pad_token_id  # special tokens were added
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(row) for row in ROWS])
    data = PromptDataset(path, plain_tokenizer, prompt_key="prompt")
    assert [(p.text, p.ids) for p in data.prompts] == [
        render(row, plain_tokenizer, prompt_key="prompt") for row in ROWS
    ]


def test_messages_without_chat_template_are_refused(
    tmp_path: Path, plain_tokenizer: PreTrainedTokenizerFast
) -> None:
    with pytest.raises(DataError, match="no chat template"):
        render({"messages": CONVERSATION}, plain_tokenizer, messages_key="messages")
    path = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"messages": CONVERSATION})])
    with pytest.raises(DataError) as exc:
        PromptDataset(path, plain_tokenizer, messages_key="messages")
    assert message(exc) == f"{path}: the tokenizer has no chat template to render 'messages' with"


def test_a_failing_chat_template_names_the_row(
    tmp_path: Path, plain_tokenizer: PreTrainedTokenizerFast
) -> None:
    plain_tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(row) for row in ROWS])
    with pytest.raises(DataError) as exc:
        PromptDataset(path, plain_tokenizer, prompt_key="prompt")
    text = message(exc)
    assert text.startswith(f"{path}: row 0: chat template failed: ")
    assert "no system messages" in text


# --- PromptDataset -----------------------------------------------------------------------


def test_prompt_dataset_renders_every_row_and_hands_the_rest_to_the_reward(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(row) for row in ROWS])
    data = PromptDataset(path, tokenizer, prompt_key="prompt")
    assert len(data) == 2 and data.skipped == 0 and data.path == str(path)
    for index, (prompt, row) in enumerate(zip(data.prompts, ROWS, strict=True)):
        assert prompt.index == index
        assert (prompt.text, prompt.ids) == render(row, tokenizer, prompt_key="prompt")
        assert prompt.row == {"answer": row["answer"], "level": row["level"]}


def test_max_prompt_tokens_drops_long_rows_and_counts_them(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    rows = [{"prompt": "1 + 1?"}, {"prompt": "What is 123 + 456? " * 4}, {"prompt": "2 + 2?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(row) for row in rows])
    lengths = [len(render(row, tokenizer, prompt_key="prompt")[1]) for row in rows]
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit
    data = PromptDataset(path, tokenizer, prompt_key="prompt", max_prompt_tokens=limit)
    assert [p.index for p in data.prompts] == [0, 2]  # indices stay the rows' numbers
    assert data.skipped == 1
    assert all(len(p.ids) <= limit for p in data.prompts)


def test_every_row_too_long_is_an_error(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(row) for row in ROWS])
    with pytest.raises(DataError) as exc:
        PromptDataset(path, tokenizer, prompt_key="prompt", max_prompt_tokens=5)
    assert message(exc) == f"{path}: all 2 rows exceed max_prompt_tokens=5"


# --- PromptOrder -------------------------------------------------------------------------


def draw(order: PromptOrder, count: int) -> list[int]:
    return [order.next() for _ in range(count)]


def test_each_epoch_is_a_permutation_that_changes_across_epochs() -> None:
    order = PromptOrder(20, seed=1)
    epochs = [draw(order, 20) for _ in range(3)]
    assert all(sorted(epoch) == list(range(20)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] != list(range(20))
    assert order.epoch == 2 and order.position == 20


def test_same_seed_same_order_other_seed_other_order() -> None:
    assert draw(PromptOrder(20, seed=7), 60) == draw(PromptOrder(20, seed=7), 60)
    assert draw(PromptOrder(20, seed=7), 20) != draw(PromptOrder(20, seed=8), 20)


def test_order_ignores_the_global_random_state() -> None:
    import random

    random.seed(1)
    first = draw(PromptOrder(20, seed=3), 40)
    random.seed(2)
    assert draw(PromptOrder(20, seed=3), 40) == first


@pytest.mark.parametrize("stop", [0, 7, 20, 33])
def test_resume_from_state_dict_continues_the_same_sequence(stop: int) -> None:
    uninterrupted = draw(PromptOrder(20, seed=5), 60)
    before = PromptOrder(20, seed=5)
    head = draw(before, stop)
    state = json.loads(json.dumps(before.state_dict()))  # as a checkpoint stores it
    after = PromptOrder(20, seed=5)
    after.load_state_dict(state)
    assert (after.epoch, after.position) == (before.epoch, before.position)
    assert head + draw(after, 60 - stop) == uninterrupted


def test_state_of_another_order_is_refused() -> None:
    state = PromptOrder(20, seed=5).state_dict()
    for other in (
        PromptOrder(21, seed=5),
        PromptOrder(20, seed=6),
        PromptOrder(20, 5, shuffle=False),
    ):
        with pytest.raises(ValueError, match="prompt order state"):
            other.load_state_dict(state)


def test_no_shuffle_goes_in_file_order() -> None:
    assert draw(PromptOrder(5, seed=9, shuffle=False), 12) == [0, 1, 2, 3, 4] * 2 + [0, 1]


# --- the tiny tokenizer and model (tests/helpers/tiny_text.py) ---------------------------


def test_tiny_tokenizer_covers_arithmetic_prompts(tokenizer: PreTrainedTokenizerFast) -> None:
    assert len(tokenizer) <= 512
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "What is 3 + 4? Answer with just the number. 0123456789"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_model_directory_loads_back(tmp_path: Path, family: Literal["llama", "qwen2"]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = save_tiny_model(tmp_path / family, family)
    model = AutoModelForCausalLM.from_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    original = tiny_tokenizer()
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(original)
    assert model.config.eos_token_id == original.eos_token_id
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == (
        original.eos_token_id
    )
    text = "What is 3 + 4?\n\n Answer: 7 café"
    assert loaded(text)["input_ids"] == original(text)["input_ids"]
    assert loaded.chat_template == original.chat_template
