"""The base of every config struct and the helpers each field uses."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


def doc(description: str, **bounds: Any) -> msgspec.Meta:
    """A field's description and bounds (``ge``, ``gt``, ``le``, ``pattern``...)."""
    return msgspec.Meta(description=description, **bounds)


Endpoint = Annotated[str, msgspec.Meta(pattern=r"^(ipc|tcp)://.+")]


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Base of every config struct: unknown keys are refused, values are immutable
    (subclasses repeat ``frozen=True`` for type checkers; msgspec inherits it)."""


def invalid(field: str, what: str) -> ValueError:
    """A cross-field rule broken; ``field`` is relative to the struct raising it."""
    return ValueError(f"{field}: {what}")
