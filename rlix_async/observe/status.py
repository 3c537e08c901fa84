"""``rlix-async status``: devices x pipelines, from a running coordinator."""

from __future__ import annotations

import asyncio
import uuid

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlix_async.protocols import messages as m
from rlix_async.security import ClientKeys, ipc_endpoint
from rlix_async.transport import RpcClient


def render(st: m.StatusReply) -> Table:
    table = Table(
        title=f"{st.devices} devices, {st.plans} plans applied, {st.rejected_plans} rejected"
    )
    table.add_column("pipeline", no_wrap=True)
    table.add_column("state", overflow="fold")
    table.add_column("devices", no_wrap=True)  # one character per device: never broken
    table.add_column("held", overflow="fold")  # narrow terminals fold, never truncate
    table.add_column("rollout ranks", overflow="fold")
    table.add_column("remaining")
    table.add_column("waiting for", overflow="fold")
    for p in st.pipelines:
        mine = "".join(_mark(o, p.id) for o in st.owners)
        state = ("admitted" if p.admitted else "registered") + ("" if p.connected else ", LOST")
        if p.members:  # a base group: its shards serve these pipelines
            state = f"base group of {', '.join(p.members)}"
        elif p.group is not None:
            state += f", served by {p.group}"
        if p.slowdown is not None:  # what finish-time fairness serves it by
            state += f", {p.slowdown:.2f}x its pace alone"
        table.add_row(
            p.id,
            state,
            mine,
            ", ".join(f"{c}:{v}" for c, v in p.held.items()),
            str(p.active_ranks),
            "-" if p.remaining is None else str(p.remaining),
            ", ".join(f"{c}:{v}" for c, v in p.requests.items()),
        )
    fenced = {d for f in st.fenced for d in f.devices}
    idle = "".join("." if o is None and d not in fenced else " " for d, o in enumerate(st.owners))
    table.add_row("(idle)", "", idle, "", "", "", "")
    for f in st.fenced:  # a shard worker may still hold these: planned for nobody
        mine = "".join("x" if d in f.devices else "." for d in range(st.devices))
        state = f"fenced {f.age_s:.0f}s: {f.reason}"
        table.add_row(f"(fence {f.pipeline}[{f.rank}])", state, mine, "", "", "", f.holder or "")
    return table


def _mark(owner: m.DeviceOwner | None, pipeline: str) -> str:
    """One character per device: # a stage of this pipeline, r its rollout shard."""
    if owner is None or owner.pipeline != pipeline:
        return "."
    return "r" if owner.rank is not None else "#"


async def fetch(client: RpcClient) -> m.StatusReply:
    reply = await client.call(m.StatusRequest(), timeout=10)
    assert isinstance(reply, m.StatusReply)
    return reply


async def show_status(
    endpoint: str | None, keys: ClientKeys | None, *, watch: bool, interval: float
) -> int:
    endpoint = endpoint or ipc_endpoint("coordinator")
    console = Console()
    async with RpcClient(endpoint, f"status-{uuid.uuid4().hex[:6]}/cli/0", keys=keys) as client:
        if not watch:
            console.print(render(await fetch(client)))
            return 0
        with Live(render(await fetch(client)), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    await asyncio.sleep(interval)
                    live.update(render(await fetch(client)))
            except (KeyboardInterrupt, asyncio.CancelledError):
                return 0
