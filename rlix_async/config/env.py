"""How a text recipe's prompt becomes a scored trajectory: a reward function on one
response, a multi-turn environment, an agent loop of your own, or an agent written
against the OpenAI API (exactly one), and the limits of an episode."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from rlix_async.config.schema_base import Config, doc, invalid


class EnvConfig(Config, frozen=True):
    reward: Annotated[
        str | None,
        doc(
            "'package.module:function', 'path/to/file.py:function' or a built-in "
            "(math_answer, exact_match, regex_format), called as fn(prompt, response, row)."
        ),
    ] = None
    reward_args: Annotated[
        dict[str, Any], doc("Keyword arguments for the reward (regex_format: pattern).")
    ] = {}
    reward_timeout_s: Annotated[
        float,
        doc(
            "A reward call taking longer counts as a failed reward (the trajectory scores 0).",
            gt=0,
        ),
    ] = 30.0
    env_class: Annotated[
        str | None,
        doc(
            "A multi-turn environment, 'package.module:Class' or 'path/to/file.py:Class', "
            "one instance per episode, built as Class(row, **env_args) with reset() and "
            "step(action) -> StepResult; its step rewards score the episode (no reward "
            "needed)."
        ),
    ] = None
    env_args: Annotated[dict[str, Any], doc("Keyword arguments for env_class.")] = {}
    workers: Annotated[
        int,
        doc(
            "Run each episode's env in one of N worker processes (CPU-heavy envs: their "
            "steps would hold the driver's GIL). 0: in threads of the driver.",
            ge=0,
        ),
    ] = 0
    agent: Annotated[
        str | None,
        doc(
            "Instead of env_class or reward: your own agent loop, 'file.py:function' or "
            "'package.module:function', called as await function(row, llm, "
            "**agent_args) per episode; llm.start(first turn) gives a conversation whose "
            "generate() samples the model's turn and add() appends a reply; it returns "
            "the episode's reward."
        ),
    ] = None
    agent_api: Annotated[
        str | None,
        doc(
            "Instead of env_class, agent or reward: an agent written against the OpenAI "
            "API, 'file.py:function' or 'package.module:function', called as await "
            "function(row, client, **agent_args) per episode, where client is an "
            "openai.AsyncOpenAI on the pipeline's own OpenAI-compatible server "
            "(/v1/chat/completions with tools, /v1/completions) with the episode's key; "
            "it returns the episode's reward (or a dict with 'reward' and numeric "
            "metrics). The server keeps each episode's tokens as sampled "
            "(rollout/api_agents.py)."
        ),
    ] = None
    api_host: Annotated[
        str,
        doc(
            "agent_api: the address its server listens on (an ephemeral port); loopback "
            "unless an agent in another container or host must reach it by URL and key."
        ),
    ] = "127.0.0.1"
    tool_call_parser: Annotated[
        str | None,
        doc(
            "agent_api: how the model's tool calls are read back, by the name `vllm serve "
            "--tool-call-parser` takes (hermes, llama3_json, qwen3_xml, pythonic, ...): "
            "the serving engine's own parser (vLLM's, for engine kind vllm; an engine "
            "of your own reads hermes only). The name is checked before any process "
            "starts; a model whose chat template renders no tools takes hermes. Unset: "
            "hermes."
        ),
    ] = None
    agent_args: Annotated[
        dict[str, Any], doc("Keyword arguments for the agent (or agent_api) function.")
    ] = {}
    max_turns: Annotated[int, doc("Episodes: model turns per episode, at most.", ge=1)] = 8
    max_episode_tokens: Annotated[
        int,
        doc(
            "Episodes: tokens after the first prompt (the model's and the env's), at "
            "most; each turn also stops at rollout.max_tokens.",
            ge=1,
        ),
    ] = 1024
    step_timeout_s: Annotated[
        float,
        doc("Env episodes: a reset or step taking longer fails its episode (counted).", gt=0),
    ] = 30.0
    episode_reward: Annotated[
        Literal["sum", "last"],
        doc("Env episodes: the episode's reward is the sum of its step rewards, or the last."),
    ] = "sum"
    fail_after_groups: Annotated[
        int,
        doc(
            "Env, agent and agent_api pipelines: stop (exit 1, naming the first failure) "
            "after this many groups in a row came back without one good episode.",
            ge=1,
        ),
    ] = 20

    @property
    def scorers(self) -> dict[str, str]:
        """What scores an episode, by key: one at most (checked)."""
        named = (
            ("reward", self.reward),
            ("env_class", self.env_class),
            ("agent", self.agent),
            ("agent_api", self.agent_api),
        )
        return {k: v for k, v in named if v}

    @property
    def multi_turn(self) -> bool:
        """Whether episodes are multi-turn (an env, an agent or an API agent)."""
        return bool(self.env_class or self.agent or self.agent_api)

    def __post_init__(self) -> None:
        scorers = self.scorers
        if len(scorers) > 1:
            names = " and ".join(scorers)
            raise invalid(list(scorers)[-1], f"{names}: name one (an env or agent scores its own)")
        for key, owner in (
            ("env_args", self.env_class),
            ("workers", self.env_class),
            ("agent_args", self.agent or self.agent_api),
            ("tool_call_parser", self.agent_api),
        ):
            if getattr(self, key) and owner is None:
                needs = {"env_args": "env_class", "workers": "env_class"}.get(key)
                needs = needs or (
                    "agent_api" if key == "tool_call_parser" else "agent or agent_api"
                )
                raise invalid(key, f"needs {needs} (what they are for)")
