"""Every field of OpenAI's Chat Completions and Completions requests, as the installed
``openai`` package's schema lists them, sent to the agent endpoint over a real socket:
each is honoured (200) or refused with a 400 whose ``param`` and message name it.
A field this table does not know (a newer package's) must be refused by name."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from helpers.episodes import CHAT, TOKENIZER, scripted_generate

from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.agents import load_agent
from rlix_async.rollout.api_agents import ApiAgentRunner
from rlix_async.rollout.api_episode import ApiEpisode
from rlix_async.rollout.api_fields import CHAT as CHAT_FIELDS
from rlix_async.rollout.api_fields import COMPLETIONS as COMPLETION_FIELDS

openai = pytest.importorskip("openai")
TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
UNSET = object()  # a field with no served value worth sending: absent is its only one

# field: (a value served, a value refused); UNSET: none of that kind
CHAT_CASES: dict[str, tuple[Any, Any]] = {
    "messages": ([{"role": "user", "content": "q"}], []),
    "model": ("anything", 5),
    "temperature": (1.0, 0.5),
    "top_p": (1.0, 0.5),
    "n": (1, 2),
    "stop": ("\n\n", 5),
    "max_tokens": (4, 0),
    "max_completion_tokens": (4, -1),
    "frequency_penalty": (0, 0.5),
    "presence_penalty": (0.0, -0.5),
    "logit_bias": ({}, {"5": 10}),
    "seed": (UNSET, 1),
    "stream": (False, UNSET),
    "stream_options": (UNSET, {"include_usage": True}),  # without stream: refused
    "user": ("u-1", 5),
    "tools": ([TOOL], [{"type": "function", "function": {"name": 3}}]),
    "logprobs": (True, "yes"),
    "top_logprobs": (0, 2),
    "tool_choice": ("none", "required"),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"}, {"type": "json_object"}),
    "functions": (UNSET, [TOOL["function"]]),
    "function_call": (UNSET, "auto"),
    "modalities": (["text"], ["text", "audio"]),
    "audio": (UNSET, {"voice": "alloy", "format": "wav"}),
    "prediction": (UNSET, {"type": "content", "content": "x"}),
    "web_search_options": (UNSET, {}),
    "reasoning_effort": (UNSET, "low"),
    "verbosity": (UNSET, "low"),
    "moderation": (UNSET, {"model": "x"}),
    "store": (False, True),
    "metadata": ({"run": "7"}, {"run": 7}),
    "service_tier": ("auto", "flex"),
    "safety_identifier": ("s-1", 5),
    "prompt_cache_key": ("k-1", 5),
    "prompt_cache_retention": (UNSET, "24h"),
    "prompt_cache_options": (UNSET, {}),
}
COMPLETION_CASES: dict[str, tuple[Any, Any]] = {
    "prompt": ("Q: 1+1?\nA:", []),
    "model": ("anything", 5),
    "temperature": (1, 0.5),
    "top_p": (1, 0.5),
    "n": (1, 2),
    "stop": (["\n"], [1]),
    "max_tokens": (4, 0),
    "frequency_penalty": (0, 1),
    "presence_penalty": (0, 1),
    "logit_bias": ({}, {"5": -100}),
    "seed": (UNSET, 3),
    "stream": (False, True),
    "stream_options": (UNSET, {"include_usage": True}),
    "user": ("u", 5),
    "logprobs": (0, 2),
    "echo": (False, True),
    "suffix": (UNSET, "end"),
    "best_of": (1, 3),
}


async def noop(row: dict[str, Any], client: Any) -> float:
    return 0.0


# values of the wrong type that equal a served one in Python (True == 1, 0 == False):
# refused, never read as the served one
WRONG_TYPES = {
    True: [("n", True), ("stream", "false"), ("store", 0), ("parallel_tool_calls", 1),
           ("top_logprobs", False), ("frequency_penalty", False), ("n", 1.0),
           ("stream_options", {"include_usage": "no"}), ("logprobs", 1)],
    False: [("logprobs", 0.0), ("logprobs", False), ("best_of", True), ("echo", 0)],
}  # fmt: skip


def _schema(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_the_tables_name_only_fields_of_openais_schemas() -> None:
    """No invented or misspelt field: each the endpoint serves is one of OpenAI's."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    assert set(CHAT_FIELDS) <= _schema(chat_params)
    assert set(COMPLETION_FIELDS) <= _schema(completion_create_params)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_every_request_field_is_honoured_or_refused_by_name(chat: bool) -> None:
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    schema = _schema(chat_params if chat else completion_create_params)
    cases = CHAT_CASES if chat else COMPLETION_CASES
    base = {"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"}
    path = "/chat/completions" if chat else "/completions"
    agent = load_agent(f"{__name__}:noop", {}, client="client")
    runner = ApiAgentRunner(agent, CHAT, TOKENIZER, host="127.0.0.1", model_name="p",
                            max_turns=1000, max_tokens=8, max_episode_tokens=100_000,
                            step_timeout_s=5.0)  # fmt: skip
    server = await runner.start()
    key, name = server.new_key()
    sampling = Sampling(max_tokens=8, temperature=1.0, top_p=1.0)
    generate = scripted_generate(["ok"] * 1000, [])
    server.open(key, ApiEpisode(runner, generate, sampling, None, name, "p"))
    outcomes: dict[str, list[int]] = {}
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            for field in sorted(schema):
                served, refused = cases.get(field, (UNSET, "not-a-value-it-serves"))
                for value, want in ((served, 200), (refused, 400)):
                    if value is UNSET:
                        continue
                    async with http.post(server.url + path, json={**base, field: value}) as r:
                        body = await r.json()
                        assert r.status == want, (field, value, body)
                        outcomes.setdefault(field, []).append(r.status)
                        if want == 400:
                            assert body["error"]["param"] == field, (field, body)
                            assert field in body["error"]["message"], (field, body)
            for field, value in WRONG_TYPES[chat]:
                body = {**base, field: value}
                if field == "stream_options":
                    body["stream"] = True
                async with http.post(server.url + path, json=body) as r:
                    answer = await r.json()
                    assert r.status == 400 and answer["error"]["param"] == field, (field, value)
            # null is absent: max_tokens null beside max_completion_tokens is not two limits
            both = {**base, "max_tokens": None, **({"max_completion_tokens": 2} if chat else {})}
            async with http.post(server.url + path, json=both) as r:
                assert r.status == 200, await r.text()
    finally:
        await server.stop()
    assert set(outcomes) == schema  # every field of the schema was sent
