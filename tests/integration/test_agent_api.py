"""``agent_api`` agents (rollout/api_agents.py, rollout/openai_server.py): functions
written against ``openai.AsyncOpenAI``, served by the pipeline's own aiohttp server
over real sockets. The router is ``scripted_generate`` (tests/helpers/episodes.py: the
router needs shards); the tiny tokenizer's chat template renders no tools, so tool
schemas and calls take the Hermes format."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
import torch
from helpers.episodes import CHAT, TOKENIZER, ids, scripted_generate

from rlix_async.protocols.batch import Group
from rlix_async.protocols.engine import ToolCallFormat
from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.agents import load_agent
from rlix_async.rollout.api_agents import ApiAgentRunner
from rlix_async.rollout.episodes import EnvFailure, Episode
from rlix_async.shards.tool_calls import HermesToolCalls, hermes_messages
from rlix_async.train.packing import pack_batch

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate arithmetic",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]
SAMPLING = Sampling(max_tokens=100, temperature=1.0, top_p=1.0)
SEEN: dict[str, Any] = {}  # what the last agent saw, for the test to read


async def two_turns(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """History kept as served: one trajectory."""
    messages: list[Any] = [{"role": "user", "content": row["q"]}]
    first = await client.chat.completions.create(model="p", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "sure?"}]  # fmt: skip
    second = await client.chat.completions.create(model="p", messages=messages, logprobs=True)
    SEEN["usage"] = [first.usage, second.usage]
    SEEN["logprobs"] = second.choices[0].logprobs
    return 1.0 if second.choices[0].message.content == "4" else 0.0


async def edits_history(row: dict[str, Any], client: openai.AsyncOpenAI) -> dict[str, Any]:
    """The second request rewrites the first question: two trajectories."""
    first = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "a?"}]
    )
    text = first.choices[0].message.content
    await client.chat.completions.create(
        model="p",
        messages=[
            {"role": "user", "content": "A?"},  # edited
            {"role": "assistant", "content": text},
            {"role": "user", "content": "b?"},
        ],
    )
    return {"reward": 0.5, "edits": 1}


async def uses_a_tool(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    messages: list[Any] = [{"role": "user", "content": "2+2?"}]
    reply = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
    msg = reply.choices[0].message
    SEEN["finish"] = reply.choices[0].finish_reason
    SEEN["calls"] = msg.tool_calls
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        args = json.loads(call.function.arguments)
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": str(eval(args["expr"]))}
        )
    final = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
    return 1.0 if final.choices[0].message.content == "4" else 0.0


async def malformed_tool(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    reply = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "x"}], tools=TOOLS
    )
    SEEN["message"] = reply.choices[0].message
    SEEN["finish"] = reply.choices[0].finish_reason
    return 0.0


async def declines_tools(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    reply = await client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"
    )
    SEEN["message"] = reply.choices[0].message
    return 0.0


async def loops(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """Never stops on its own: the server's max_turns ends it (the 400 uncaught)."""
    messages: list[Any] = [{"role": "user", "content": "go"}]
    while True:
        r = await client.chat.completions.create(model="p", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "more"}]  # fmt: skip


async def asks_wrongly(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    errors = []
    one = [{"role": "user", "content": "q"}]
    for extra in ({"temperature": 0.2}, {"top_p": 0.5}, {"n": 2}, {"max_tokens": 0},
                  {"stop": ["a"] * 5}):  # fmt: skip
        try:
            await client.chat.completions.create(model="p", messages=one, **extra)  # type: ignore[call-overload]
        except openai.BadRequestError as exc:
            errors.append(exc.message)
    SEEN["errors"] = errors
    r = await client.chat.completions.create(model="p", messages=one, max_tokens=2)
    SEEN["short"] = r.choices[0].finish_reason, r.usage.completion_tokens if r.usage else None
    # a key of its own only: another key is refused
    other = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="rlix-guess", max_retries=0)
    try:
        await other.chat.completions.create(model="p", messages=one)
    except openai.AuthenticationError as exc:
        SEEN["other"] = exc.status_code
    finally:
        await other.close()
    SEEN["url"] = str(client.base_url)
    return 1.0


async def raises(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}])
    raise RuntimeError("my scaffold broke")


def runner(fn: Any, tool_calls: ToolCallFormat | None = None, **limits: Any) -> ApiAgentRunner:
    settings: dict[str, Any] = dict(
        max_turns=4, max_tokens=16, max_episode_tokens=400, step_timeout_s=5.0
    )
    settings.update(limits)
    agent = load_agent(f"{__name__}:{fn.__name__}", {}, client="client")
    return ApiAgentRunner(
        agent, CHAT, TOKENIZER, host="127.0.0.1", model_name="p", tool_calls=tool_calls,
        **settings,
    )  # fmt: skip


def _formats() -> list[Any]:
    """The package's Hermes parser, and vLLM's (its hermes) where vLLM is installed:
    the endpoint reads the same calls through either."""
    formats: list[Any] = [pytest.param(HermesToolCalls, id="own-hermes")]
    try:
        from rlix_async.shards.vllm.tool_parsers import VllmToolCalls

        if VllmToolCalls.available():
            formats.append(pytest.param(lambda tok: VllmToolCalls("hermes", tok), id="vllm-hermes"))
    except ImportError:
        pass
    return formats


async def run(
    fn: Any,
    turns: list[str],
    seen: list[list[int]] | None = None,
    tool_calls: ToolCallFormat | None = None,
    **limits: Any,
) -> Episode:
    r = runner(fn, tool_calls, **limits)
    try:
        return await r.run(
            {"q": "2+2?"}, scripted_generate(turns, [] if seen is None else seen), SAMPLING
        )
    finally:
        await r.server.stop()


async def test_a_history_kept_as_served_is_one_trajectory_of_the_sampled_tokens() -> None:
    seen: list[list[int]] = []
    ep = await run(two_turns, ["four", "4"], seen)
    assert ep.reward == 1.0 and ep.turns == 2 and ep.splits == 0 and not ep.segments
    prompt = CHAT.first([{"role": "user", "content": "2+2?"}])
    reply = CHAT.reply([{"role": "user", "content": "sure?"}], ids("four"))
    assert ep.prompt_ids == prompt
    assert ep.token_ids == ids("four") + reply + ids("4")  # never re-rendered
    assert ep.mask == [1] * 4 + [0] * len(reply) + [1]
    assert seen[1] == prompt + ids("four") + reply
    first, second = SEEN["usage"]
    # what the agent was told it used: exactly the trajectory
    assert first.completion_tokens + second.completion_tokens == sum(ep.mask)
    assert second.prompt_tokens == len(prompt) + 4 + len(reply)
    assert [t.logprob for t in SEEN["logprobs"].content] == [-1.0]  # the sampler's


async def test_an_edited_history_splits_the_episode_and_both_parts_train() -> None:
    ep = await run(edits_history, ["x", "y"])
    assert ep.splits == 1 and len(ep.segments) == 1
    (before,) = ep.segments
    assert before.token_ids == ids("x") and before.reward == ep.reward == 0.5
    assert ep.info == {"edits": 1.0}
    edited = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "x"},
              {"role": "user", "content": "b?"}]  # fmt: skip
    assert ep.prompt_ids == CHAT.first(hermes_messages(edited, None))
    assert ep.token_ids == ids("y") and ep.figures()["api_splits"] == 1.0


def test_a_split_episode_weighs_once_in_its_groups_advantages() -> None:
    """Episode 0 split in two (reward 1), episode 1 whole (reward 0): both parts of
    episode 0 get its advantage, computed over the two episodes, not three rows."""
    g = Group(prompt=[1], responses=[[2], [3], [4]], logprobs=[[0.0]] * 3,
              versions=[[0]] * 3, rewards=[1.0, 1.0, 0.0], members=[0, 0, 1])  # fmt: skip
    adv = pack_batch([g], 0, 1)["adv"]
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -1.0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="one member index per response"):
        Group(prompt=[1], responses=[[2], [3]], logprobs=[[0.0]] * 2, versions=[[0]] * 2,
              rewards=[1.0, 0.0], members=[0, 2])  # fmt: skip


@pytest.mark.parametrize("fmt", _formats())
async def test_tool_calls_round_trip_in_the_hermes_format(fmt: Any) -> None:
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
    seen: list[list[int]] = []
    ep = await run(uses_a_tool, [call, "4"], seen, fmt(TOKENIZER), max_tokens=100)
    assert ep.reward == 1.0 and ep.splits == 0 and SEEN["finish"] == "tool_calls"
    (c,) = SEEN["calls"]
    assert c.function.name == "calc" and json.loads(c.function.arguments) == {"expr": "2+2"}
    first = TOKENIZER.decode(seen[0])
    assert "<tools>" in first and '"name": "calc"' in first  # the schemas, in the system prompt
    second = TOKENIZER.decode(seen[1][len(seen[0]) + len(ids(call)) :])
    assert "<tool_response>\n4\n</tool_response>" in second  # the tool's result, a reply


@pytest.mark.parametrize("fmt", _formats())
async def test_a_malformed_tool_call_is_plain_content(fmt: Any) -> None:
    for text in ['<tool_call>{"name": "calc", "arguments": </tool_call>',
                 '<tool_call>["calc"]</tool_call>', "no call at all"]:  # fmt: skip
        await run(malformed_tool, [text], None, fmt(TOKENIZER), max_tokens=100)
        assert SEEN["message"].content == text and not SEEN["message"].tool_calls
        assert SEEN["finish"] in ("stop", "length")


async def test_tool_choice_none_reads_no_call_as_vllm_serves_it() -> None:
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
    await run(declines_tools, [call], max_tokens=100)
    assert SEEN["message"].content == call and not SEEN["message"].tool_calls


async def test_limits_and_sampling_settings_are_400s_and_keys_are_the_episodes() -> None:
    ep = await run(asks_wrongly, ["ab", "c"])
    errors = SEEN["errors"]
    assert len(errors) == 5
    assert "this pipeline samples at temperature 1, top_p 1" in errors[0]
    assert "top_p" in errors[1] and "n 2: must be 1" in errors[2] and "max_tokens 0" in errors[3]
    assert "stop: at most 4" in errors[4]
    assert SEEN["short"] == ("length", 2) and SEEN["other"] == 401
    assert ep.turns == 1 and ep.token_ids == ids("ab")  # refused requests left no trace
    # the episode is over: its key is gone, and the server is too
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(SEEN["url"] + "/models")


async def test_max_turns_ends_a_loop_that_lets_the_error_through() -> None:
    ep = await run(loops, ["a"] * 5, max_turns=3)
    assert ep.turns == 3 and ep.cut == "max_turns" and ep.reward == 0.0


async def test_an_agent_that_raises_fails_its_episode_only() -> None:
    with pytest.raises(EnvFailure, match="raised RuntimeError: my scaffold broke"):
        await run(raises, ["a"])
    ep = await run(two_turns, ["four", "4"])  # the next episode runs as usual
    assert ep.reward == 1.0


async def test_garbage_requests_get_errors_and_the_server_goes_on() -> None:
    """Malformed bodies and headers, as a fuzzer sends them: each a 4xx JSON error, and
    a well-formed request after them is served."""
    r = runner(two_turns)
    server = await r.start()
    key, name = server.new_key()
    from rlix_async.rollout.api_episode import ApiEpisode

    episode = ApiEpisode(r, scripted_generate(["ok"] * 3, []), SAMPLING, None, name, "p")
    server.open(key, episode)
    url = server.url + "/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    bodies: list[bytes] = [
        b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe", json.dumps({"messages": []}).encode(),
        json.dumps({"messages": "hi"}).encode(), json.dumps({"messages": [{"role": 3}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": {"a": 1}}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": "calc"}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
        b"x" * (9 << 20),
    ]  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            for body in bodies:
                async with http.post(url, data=body, headers=auth) as resp:
                    assert 400 <= resp.status < 500, (body[:60], resp.status)
                    assert "message" in (await resp.json())["error"]
            bad_prompts = [{"prompt": {}}, {"prompt": [99999]}, {"prompt": ""}, {"prompt": [True]},
                           {"prompt": "x", "stream": True}, {"prompt": ["a", "b"]}]  # fmt: skip
            for bad in bad_prompts:
                async with http.post(server.url + "/completions", json=bad, headers=auth) as resp:
                    assert resp.status == 400, (bad, resp.status)
            for headers in ({}, {"Authorization": "Basic x"}, {"Authorization": "Bearer "}):
                async with http.post(url, data=b"{}", headers=headers) as resp:
                    assert resp.status == 401
            async with http.post(server.url + "/nope", data=b"{}", headers=auth) as resp:
                assert resp.status == 404
            good = {"messages": [{"role": "user", "content": "x"}]}
            async with http.post(url, json=good, headers=auth) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["message"]["content"] == "ok"
            async with http.get(server.url + "/models", headers=auth) as resp:
                assert (await resp.json())["data"][0]["id"] == "p"
    finally:
        await server.stop()
    assert episode.turns == 1  # only the good request reached the model


async def streams(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    messages: list[Any] = [{"role": "user", "content": "2+2?"}]
    stream = await client.chat.completions.create(
        model="p", messages=messages, tools=TOOLS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    SEEN["chunks"] = chunks
    return 1.0


async def test_a_streamed_request_gets_the_reply_as_chunks() -> None:
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
    ep = await run(streams, [call], max_tokens=100)
    chunks = SEEN["chunks"]
    delta = chunks[0].choices[0].delta
    assert delta.role == "assistant" and delta.tool_calls[0].function.name == "calc"
    assert chunks[1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(ep.token_ids) == len(ids(call))


async def abandons(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """One turn, then a second request it never waits for: the episode ends under it."""
    import asyncio

    messages: list[Any] = [{"role": "user", "content": "a"}]
    first = await client.chat.completions.create(model="p", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "b"}]  # fmt: skip
    SEEN["abandoned"] = asyncio.ensure_future(
        client.chat.completions.create(model="p", messages=messages)
    )
    await SEEN["started"].wait()  # its generation is under way
    try:  # a second request of the same episode meanwhile: one at a time
        await client.chat.completions.create(model="p", messages=messages)
    except openai.ConflictError as exc:
        SEEN["conflict"] = exc.status_code
    return 1.0


async def test_an_episode_that_ends_under_a_request_keeps_nothing_of_it() -> None:
    """The agent returned while its request was being sampled: the generation is
    cancelled (no engine slot keeps decoding for nobody), nothing lands in the
    trajectory it returned, and the request ends (its client and key died with it)."""
    import asyncio

    from rlix_async.shards.router import Trajectory

    SEEN["started"] = asyncio.Event()
    cancelled = asyncio.Event()
    calls = 0

    async def generate(prompt_ids: list[int], sampling: Sampling, **_: Any) -> Trajectory:
        nonlocal calls
        calls += 1
        if calls == 2:
            SEEN["started"].set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        out = ids("ok")
        return Trajectory(list(prompt_ids), out, [-1.0] * len(out), [3] * len(out))

    r = runner(abandons)
    try:
        ep = await r.run({}, generate, SAMPLING)
        # the episode's client closed with it: its request ends unanswered
        with pytest.raises((openai.AuthenticationError, openai.APIConnectionError)):
            await SEEN["abandoned"]
    finally:
        assert r.server is not None
        await r.server.stop()
    assert cancelled.is_set() and SEEN["conflict"] == 409
    assert ep.turns == 1 and ep.token_ids == ids("ok") and ep.mask == [1, 1]


async def recovers(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """Its history outgrows the episode's tokens (a 400); it starts over shorter."""
    messages: list[Any] = [{"role": "user", "content": "q"}]
    for _ in range(3):
        try:
            r = await client.chat.completions.create(model="p", messages=messages)
        except openai.BadRequestError as exc:
            SEEN["refused"] = exc.message
            messages = [{"role": "user", "content": "q again"}]  # a fresh, short history
            continue
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "x" * 40}]  # fmt: skip
    return 1.0


async def test_a_refusal_the_agent_recovers_from_ends_nothing() -> None:
    """A request refused at max_episode_tokens after a history grew, then a shorter
    one served: a split, and the episode is not counted as cut at that limit."""
    ep = await run(recovers, ["abc"] * 3, max_episode_tokens=30)
    assert "max_episode_tokens 30" in SEEN["refused"]
    assert ep.cut == "" and ep.splits == 1 and ep.reward == 1.0
    (before,) = ep.segments
    assert before.token_ids[:3] == ids("abc") and sum(before.mask) == 3


async def completes(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """/v1/completions: a text prompt, continued; then the prompt plus that completion
    plus more (reused), then an unrelated prompt (a split)."""
    first = await client.completions.create(model="p", prompt="Q: 2+2?\nA:", logprobs=0)
    SEEN["completion"] = first
    again = "Q: 2+2?\nA:" + first.choices[0].text + "\nQ: sure?\nA:"
    await client.completions.create(model="p", prompt=again)
    await client.completions.create(model="p", prompt=[5, 6, 7])  # token ids
    # a chat request after a text completion: its messages extend nothing served as chat
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}])
    return 1.0


async def test_text_completions_reuse_what_was_served_and_split_otherwise() -> None:
    seen: list[list[int]] = []
    ep = await run(completes, ["4", "yes", "z", "w"], seen)
    first = SEEN["completion"]
    assert first.choices[0].text == "4" and first.usage.completion_tokens == 1
    assert first.choices[0].logprobs.token_logprobs == [-1.0]
    prompt = ids("Q: 2+2?\nA:")
    assert seen[1] == prompt + ids("4") + ids("\nQ: sure?\nA:")  # reused, not re-tokenized
    before, ids_only = ep.segments
    assert before.prompt_ids == prompt and before.mask == [1] + [0] * 12 + [1] * 3
    assert ids_only.prompt_ids == [5, 6, 7] and ids_only.token_ids == ids("z")
    assert ep.prompt_ids == CHAT.first([{"role": "user", "content": "q"}]) and ep.splits == 2


async def runs_a_harness(row: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """Hands its endpoint to a child process the way harnesses expect it: the env."""
    import asyncio
    import sys

    show = "import os; print(os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY'])"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", show, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await child.communicate()
    SEEN["child"] = out.decode().split()
    SEEN["client"] = [str(client.base_url).rstrip("/"), client.api_key]
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}])
    return 1.0


async def test_a_child_process_of_the_agent_gets_the_episodes_endpoint_in_its_env() -> None:
    import os

    before = os.environ.get("OPENAI_API_KEY")
    await run(runs_a_harness, ["a"])
    assert SEEN["child"] == SEEN["client"] and SEEN["child"][1].startswith("rlix-")
    assert os.environ.get("OPENAI_API_KEY") == before  # the driver's own environment: as it was


async def test_episodes_starting_together_all_wait_for_the_server() -> None:
    """The first episode starts the server; the ones starting beside it must not get
    its address before it listens."""
    import asyncio

    r = runner(two_turns)
    try:
        eps = await asyncio.gather(
            *(
                r.run({"q": "2+2?"}, scripted_generate(["four", "4"], []), SAMPLING)
                for _ in range(6)
            )
        )
    finally:
        assert r.server is not None
        await r.server.stop()
    assert [e.reward for e in eps] == [1.0] * 6


async def test_a_fuzz_of_mutated_requests_never_breaks_the_server() -> None:
    """600 requests, each a well-formed body with one to three fields replaced by a
    value of the wrong kind (seeded): every answer a 200 or a 4xx with a JSON error,
    never a 5xx, and the server answers a good request afterwards."""
    import random

    from rlix_async.rollout.api_episode import ApiEpisode

    rng = random.Random(7)
    values: list[Any] = [None, True, -1, 0, 3, 1e308, float("nan"), "", "x" * 5000, "\ud800",
                         "é🙂", [], {}, [{}], [None], [1, 2], {"a": [{"b": {}}]},
                         [{"role": "user"}], [{"role": "tool", "content": None}],
                         [{"role": "assistant", "tool_calls": [{"function": "x"}]}],
                         [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                         [{"type": "function", "function": {"name": 3}}]]  # fmt: skip
    fields = ["messages", "tools", "max_tokens", "temperature", "top_p", "n", "stop",
              "logprobs", "top_logprobs", "stream", "prompt", "stream_options",
              "max_completion_tokens", "tool_choice"]  # fmt: skip
    r = runner(two_turns, max_turns=1000, max_episode_tokens=100_000)
    server = await r.start()
    key, name = server.new_key()
    episode = ApiEpisode(r, scripted_generate(["ok"] * 1000, []), SAMPLING, None, name, "p")
    server.open(key, episode)
    statuses: dict[int, int] = {}
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                path = rng.choice(["/chat/completions", "/completions"])
                body: dict[str, Any] = (
                    {"prompt": "x"} if path == "/completions"
                    else {"messages": [{"role": "user", "content": "x"}]}
                )  # fmt: skip
                for field in rng.sample(fields, rng.randint(1, 3)):
                    body[field] = rng.choice(values)
                auth = {"Authorization": f"Bearer {key}"} if rng.random() < 0.9 else {}
                data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
                async with http.post(server.url + path, data=data, headers=auth) as resp:
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    assert resp.status == 200 or 400 <= resp.status < 500, (body, resp.status)
                    if resp.status != 200 and resp.content_type == "application/json":
                        assert "message" in (await resp.json())["error"]
            good = {"messages": [{"role": "user", "content": "x"}]}
            auth = {"Authorization": f"Bearer {key}"}
            async with http.post(server.url + "/chat/completions", json=good, headers=auth) as resp:
                assert resp.status == 200
    finally:
        await server.stop()
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0 and statuses.get(401, 0) > 0
