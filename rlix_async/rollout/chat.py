"""A multi-turn episode's token ids, extended a turn at a time through the chat template.

The rollout owns the token ids: an episode is the first prompt's ids, then each
model turn exactly as sampled, then each environment reply rendered on its own and
appended. The history is never re-rendered (a re-tokenized history differs from what
the model sampled at turn boundaries, and training on that is training on text the
model never produced; verl and SkyRL document runs that do not converge when it is).

How a reply is rendered, for any chat template: a fixed base conversation is
rendered alone and again with the reply's messages and the generation prompt after
it; what the second adds to the first is the reply (``<|im_start|>user ...
<|im_start|>assistant\\n`` for ChatML). The base is a user message and an assistant
message holding a sentinel, or, for templates that render the last assistant turn
differently (Qwen3's empty ``<think>`` block), the user message alone: the first that
renders a reply as a continuation, checked once at load. What the template writes
after the sentinel closes an assistant turn (``<|im_end|>\\n``); the model's turn gets
it too, less the end-of-turn token when the model wrote that itself.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]
SENTINEL = "\u2063rlix-turn\u2063"  # text no real turn contains
PROBE: Messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]


class ChatError(ValueError):
    """The chat template cannot render what an environment returned: one line."""


def as_messages(turn: str | Messages, what: str) -> Messages:
    """An environment's turn as chat messages: text is one user message."""
    if isinstance(turn, str):
        return [{"role": "user", "content": turn}]
    if isinstance(turn, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in turn
    ):
        return turn
    raise ChatError(f"{what}: expected text or a list of {{role, content}} messages")


class ChatTurns:
    """Token ids of an episode's first prompt and of each environment reply."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError("an environment needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        probe = self._render(PROBE, generation_prompt=False)
        at = probe.rfind(SENTINEL)
        if at < 0:
            raise ChatError("the chat template drops assistant messages; cannot render turns")
        self.close_ids = self._ids(probe[at + len(SENTINEL) :])
        for base in (PROBE, PROBE[:1]):
            self.base, self.base_text = base, self._render(base, generation_prompt=False)
            try:
                self.reply("x", [])
                break
            except ChatError:
                continue
        else:
            raise ChatError("the chat template does not render a reply as a continuation")

    def _render(
        self, messages: Messages, *, generation_prompt: bool, tools: list[Any] | None = None
    ) -> str:
        try:
            extra = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
            )
        except Exception as exc:  # jinja raises its own kinds; templates may raise anything
            raise ChatError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise ChatError(f"chat template gave {type(text).__name__}, expected text")
        return text

    def _ids(self, text: str) -> list[int]:
        # the template's text holds its special tokens already: none added
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(self, turn: str | Messages, tools: list[Any] | None = None) -> list[int]:
        """The episode's prompt: the environment's first turn and the generation prompt
        (``tools``: schemas for a template that renders them)."""
        messages = as_messages(turn, "reset()")
        return self._ids(self._render(messages, generation_prompt=True, tools=tools))

    def reply(self, turn: str | Messages | None, model_ids: list[int]) -> list[int]:
        """What follows the model's turn ``model_ids``: the end of that turn, the
        environment's messages (none: ``turn`` is None) and the next generation prompt."""
        messages = [] if turn is None else as_messages(turn, "step().observation")
        text = self._render(self.base + messages, generation_prompt=True)
        if not text.startswith(self.base_text):
            raise ChatError("the chat template renders earlier turns differently after a reply")
        close = self.close_ids
        if close and model_ids and model_ids[-1] == close[0]:
            close = close[1:]  # the model ended its turn itself
        return close + self._ids(text[len(self.base_text) :])
