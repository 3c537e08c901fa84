"""What a driver key may claim: its pipelines' devices, weight, base group and the
priorities they request, checked against the key's allowance (``authorized/NAME.allow``,
written by ``rlix-async keygen --role driver --devices ... --max-weight ...``).

Without keys (ipc: one user) and for keys without an allowance file there are no
limits; the coordinator names the latter at start. Refusals are one line naming the
key and the limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlix_async.protocol import ErrorCode, RpcError
from rlix_async.protocols.topology import ClusterSpec, Priority
from rlix_async.security import AccessList, Principal, SecurityError, format_devices


def check_claim(
    principal: Principal | None,
    pipeline: str,
    clusters: Mapping[Any, ClusterSpec],
    weight: float,
    group: str | None,
) -> None:
    """Refuse a registration (or a resume) that claims more than the caller's key may."""
    allow = principal.allowance if principal is not None else None
    if allow is None:
        return
    assert principal is not None
    who = principal.describe()
    if allow.devices is not None:
        named = {d for spec in clusters.values() for d in spec.devices}
        outside = frozenset(named - allow.devices)
        if outside:
            raise RpcError(
                ErrorCode.FORBIDDEN,
                f"{pipeline}: devices {format_devices(outside)} are outside {who}'s "
                f"allowance ({format_devices(allow.devices)})",
            )
    if allow.max_weight is not None and weight > allow.max_weight:
        raise RpcError(
            ErrorCode.FORBIDDEN,
            f"{pipeline}: weight {weight:g} is over {who}'s max_weight {allow.max_weight:g}",
        )
    if group is not None and group not in allow.groups:
        raise RpcError(
            ErrorCode.FORBIDDEN,
            f"{pipeline}: {who} may not join or create base group {group!r} "
            f"(its groups: {', '.join(sorted(allow.groups)) or 'none'})",
        )


def check_priority(principal: Principal | None, pipeline: str, priority: str) -> None:
    """Refuse a non-preemptable request more important than the key's max_priority."""
    allow = principal.allowance if principal is not None else None
    if allow is None or allow.max_priority is None:
        return
    assert principal is not None
    asked = Priority[priority]
    if asked != Priority.GENERATION and asked < Priority[allow.max_priority]:
        raise RpcError(
            ErrorCode.FORBIDDEN,
            f"{pipeline}: priority {priority} is above {principal.describe()}'s max_priority "
            f"{allow.max_priority}",
        )


def check_allowances(access: AccessList) -> list[str]:
    """Refuse (SecurityError, one line) an allowance naming no priority we know; returns
    the driver keys that have no allowance (no limits: worth a warning)."""
    unlimited = []
    for principal in access.principals.values():
        allow = principal.allowance
        if principal.role == "driver" and allow is None:
            unlimited.append(principal.name)
        elif allow is not None and allow.max_priority not in (None, *Priority.__members__):
            raise SecurityError(
                f"allowance of key {principal.name!r}: max_priority {allow.max_priority!r} "
                f"is not one of {', '.join(Priority.__members__)}"
            )
    return sorted(unlimited)
