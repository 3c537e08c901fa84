"""Tool calls in the Hermes format: the tool-call format the vLLM engine declares
today (shards/vllm/backend.py), and one an engine of your own may return.

A template that takes ``tools`` (it names them: Qwen2.5, Llama 3.1, Hermes) renders the
request's tool schemas and tool messages itself. One that does not (SmolLM2's) gets
them the way Hermes-trained models read them: the schemas in the system prompt inside
``<tools></tools>``, each call the model makes as ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, and a tool's result as a user turn inside
``<tool_response></tool_response>``. :func:`parse_tool_calls` reads the model's text
back into OpenAI ``tool_calls``; text that is not a well-formed call stays content
(a malformed call is the model's answer, never a server error).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

Messages = list[dict[str, Any]]

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function call "
    "return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def text_of(content: Any) -> str:
    """A message's content as text: a string, None (""), or OpenAI's list of parts, of
    which only text parts are taken (ValueError for anything else)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part of type {kind!r}: only text is served")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"content must be text or a list of text parts, not {type(content).__name__}")


def call_text(call: dict[str, Any]) -> str:
    """An OpenAI tool call as the model writes it."""
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        parsed = args
    body = json.dumps({"name": fn.get("name", ""), "arguments": parsed}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_messages(messages: Messages, tools: list[dict[str, Any]] | None) -> Messages:
    """``messages`` for a template that knows no tools: the schemas in the system
    prompt, calls and results as text, every content a string."""
    out: Messages = []
    for m in messages:
        role, content = m.get("role"), text_of(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}".strip()})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": str(role), "content": content})
    if tools:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = SYSTEM.format(tools=schemas)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def parse_tool_calls(text: str, call_id: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The model's text as (content, tool_calls): every ``<tool_call>`` block a JSON
    object with a string ``name`` and object ``arguments``; otherwise (any block
    malformed, or none) the whole text is content and there are no calls. Call ids are
    ``call_id`` plus the call's number."""
    blocks = _CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for i, block in enumerate(blocks):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not (
            isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict)
        ):
            return text, []
        calls.append(
            {
                "id": f"{call_id}_{i}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": json.dumps(args, ensure_ascii=False),
                },
            }
        )
    content = _CALL.sub("", text).strip()
    return (content or None), calls


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates that render tools expect it (vLLM's rendering): text
    content, no None-valued keys (``'tool_calls' in message`` tests), and each call's
    arguments as an object (templates ``tojson`` them: a JSON string would be quoted
    twice)."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = text_of(message.get("content"))
    calls = []
    for call in out.get("tool_calls") or []:
        fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):
                fn["arguments"] = json.loads(fn["arguments"])
        calls.append({**call, "function": fn} if isinstance(call, dict) else call)
    if calls:
        out["tool_calls"] = calls
    return out


class HermesToolCalls:
    """The :class:`~rlix_async.protocols.engine.ToolCallFormat` of Hermes-style models,
    read by this module's own parser: what an engine of your own gets (vLLM's backend
    uses vLLM's parsers, shards/vllm/tool_parsers.py). A template that renders tools
    gets them (and the messages as such templates expect them, :func:`for_template`);
    one that does not gets them in the system prompt (:func:`hermes_messages`). Calls
    are read back with :func:`parse_tool_calls` from the turn's text, special tokens
    skipped."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prepare(self) -> None:
        return None

    def render(
        self, messages: Messages, tools: list[dict[str, Any]] | None
    ) -> tuple[Messages, list[dict[str, Any]] | None]:
        """The template's own rendering of tools where it has one (as ``vllm serve``
        renders them), else the Hermes system prompt."""
        if template_takes_tools(self.tokenizer):
            return [for_template(m) for m in messages], tools
        return hermes_messages(messages, tools), None

    def text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """A turn's text."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def parse(
        self, token_ids: list[int], call_id: str, tools: list[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_tool_calls(self.text(token_ids), call_id)
