"""``rlix-async node-cache --pipeline P``: this node's receiver of ``P``'s weights
(``weights/node_cache.py``). ``rlix-async launch --node K`` runs one for each pipeline
whose shards run on node K while its trainer's rank 0 (the weights' owner) runs
elsewhere, and starts it again if it dies; its segments go when it stops."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from rlix_async.aio import Supervisor, stop_signals
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.weights.node_cache import NodeCache, NodeCacheServer
from rlix_async.weights.node_link import node_cache_endpoint

log = logging.getLogger(__name__)


async def serve(
    pipeline: str, keys_dir: str | None, address: str = "", prefetch: bool = True
) -> None:
    """``address``: this node's, where it relays versions to the nodes behind it.
    ``prefetch``: take each new version as the owner publishes it (the pipeline's
    ``weights.prefetch``), not only when a worker here asks."""
    # the node's shard key, as the shards on this node pull with (P/weights/* identities);
    # its relay serves with the same pair (the owner checks it is the one it connected with)
    name, keys = (
        ClientKeys.load_first(keys_dir, f"shard-{socket.gethostname()}", "shard", "client")
        if keys_dir
        else ("", None)
    )

    def report(pulled: dict[str, object]) -> None:
        # one line per pull begun and per version received (its log is the node's record)
        if pulled.get("event") == "pulling":
            print(
                f"pulling version {pulled['version']} of {pipeline} "
                f"from {pulled['source'] or 'owner'}",
                flush=True,
            )
            return
        mib = int(pulled["bytes"]) / (1 << 20)  # type: ignore[call-overload]
        print(
            f"received version {pulled['version']} of {pipeline}: {mib:.1f} MiB "
            f"in {pulled['seconds']} s from {pulled['source']}",
            flush=True,
        )

    cache = NodeCache(
        pipeline,
        keys=keys,
        report=report,
        relay_address=address,
        server_keys=ServerKeys.load(keys_dir, name) if keys_dir and address else None,
        remember=Path(node_cache_endpoint(pipeline).removeprefix("ipc://")).with_suffix(".ref"),
    )
    server = await NodeCacheServer(cache).start()
    stop = stop_signals()
    failed: list[str] = []

    def died(name: str, exc: BaseException) -> None:
        # the process ends with an error: the launcher starts another receiver
        failed.append(f"{name}: {exc}")
        stop.set()

    tasks = Supervisor("node-cache", on_failure=died)
    try:
        if prefetch:
            tasks.spawn(cache.prefetch(), "prefetch")
        print(f"READY node-cache {pipeline} {server.endpoint}", flush=True)
        await stop.wait()
    finally:
        await tasks.close()
        await server.close()
        await cache.aclose(forget=not failed)
        log.info("node cache of %s removed", pipeline)
    if failed:
        raise SystemExit(f"node cache of {pipeline}: {failed[0]}")
