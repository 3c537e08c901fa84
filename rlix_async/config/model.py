"""The policy model a pipeline trains and serves: a Hugging Face directory, or a random
tiny Llama's shape (tests and the quick demo)."""

from __future__ import annotations

from typing import Annotated

from rlix_async.config.schema_base import Config, doc, invalid


class ModelConfig(Config, frozen=True):
    path: Annotated[
        str | None,
        doc("Hugging Face model directory (trainer and shards). Unset: a random tiny Llama."),
    ] = None
    vocab_size: Annotated[int, doc("Tiny Llama: vocabulary size.", ge=2)] = 512
    layers: Annotated[int, doc("Tiny Llama: decoder layers.", ge=1)] = 2
    hidden: Annotated[
        int, doc("Tiny Llama: hidden size (heads of 64, as vLLM's CPU attention needs).", ge=64)
    ] = 128

    def __post_init__(self) -> None:
        if self.hidden % 64:
            raise invalid("hidden", f"must be a multiple of 64, got {self.hidden}")

    @property
    def tiny(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size, "layers": self.layers, "hidden": self.hidden}
