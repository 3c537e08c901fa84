"""The coordinator process (``rlix-async coordinator``): serve until SIGINT or SIGTERM,
exit to be restarted on the journal when it cannot go on. The coordinator itself is
:class:`~rlix_async.control.coordinator.Coordinator`."""

from __future__ import annotations

import asyncio
import gc

from rlix_async.aio import stop_signals
from rlix_async.config import CoordinatorConfig
from rlix_async.control.coordinator import Coordinator
from rlix_async.security import ServerKeys, ipc_endpoint
from rlix_async.transport import TransportConfig

FULL_GC_EVERY = 100  # young collections of generation 1 per full one (Python's default: 10)


def quiet_gc() -> None:
    """Keep the cyclic garbage collector's pauses short on a loop that must answer in
    milliseconds. What exists once the coordinator has started (modules, config, the
    replayed journal) is mostly alive for the life of the process: frozen, full
    collections no longer walk it (cycles among the few of those objects that die
    later are not reclaimed: bounded by the startup heap). And full collections run a
    tenth as often: at 4,096 peers they stopped the loop for 25-80 ms about every two
    seconds (docs/PERF.md, "Coordinator at cluster scale"). Garbage without cycles is
    freed at once by reference counting either way; cyclic garbage waits longer."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_GC_EVERY)


async def serve(cfg: CoordinatorConfig) -> None:
    """The coordinator process: serve until SIGINT or SIGTERM (``rlix-async coordinator``)."""
    from rlix_async.observe.metrics import Metrics

    metrics = Metrics(cfg.metrics_port, cfg.metrics_host) if cfg.metrics_port is not None else None
    coord = Coordinator(
        cfg.endpoint or ipc_endpoint("coordinator"),
        cfg.cluster,
        journal=cfg.journal,
        keys=ServerKeys.load(cfg.keys) if cfg.keys else None,
        transport=TransportConfig.with_heartbeat(
            cfg.heartbeat_interval_s, io_threads=cfg.io_threads
        ),
        config=cfg.scheduler,
        on_status=metrics.update if metrics is not None else None,
    )
    try:
        await coord.start()
        quiet_gc()
        signalled: asyncio.Future[object] = asyncio.ensure_future(stop_signals().wait())
        print(f"READY {coord.endpoint}", flush=True)  # handlers first: SIGTERM is clean
        assert coord.fatal is not None
        fatal: asyncio.Future[object] = coord.fatal  # type: ignore[assignment]  # str is an object
        await asyncio.wait([signalled, fatal], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        await coord.close()
        if coord.fatal.done():  # the launcher restarts us on the journal
            raise SystemExit(f"coordinator: {coord.fatal.result()}; exiting to be restarted")
    finally:
        if metrics is not None:
            metrics.close()
