"""``rlix-async bench weights --hosts N``: a weight version reaching every shard worker
of N hosts over links shaped to R Mbit/s, with and without node caches.

Hosts are network namespaces of this machine (``bench/hosts.py``: each its own
hostname and ``/dev/shm``), their veth links shaped with ``tc`` (a token bucket each
way). Host 0 runs the owner: a real ``WeightCache`` (``--model-mb`` of transformer-like
tensors) and its ``WeightServer`` on tcp with CURVE keys, by the pipeline's transport
(``--transport``). Hosts 1..N each run ``K x T`` worker processes (K shards of
tensor-parallel size T) and, with ``--path node`` (the default), the node's real
receiver (``rlix-async node-cache``). A worker's load is the ``rlix_shm`` backend's
own (``weights/staging.py::fetch_version``, as ``RlixShmTransferEngine.receive_weights``
calls it, then ``load_fetched`` as at ``finish_weight_update``); what stands in
for vLLM's model is a dict of plain tensors, into which each rank copies its own
slice of every tensor (dim 0 split T ways, as a column-parallel loader narrows it).
No coordinator: this process hands the workers each version's ref through a shared
directory (the coordinator's part of a sync is timed in ``bench coordinator``).
``--path worker`` is today's path without node caches: every worker pulls its own
private copy from the owner.

Per version: ``owner_egress_per_model`` (host 0's sent bytes from the kernel's counter,
over the model's bytes), ``seconds_to_all`` (from publishing to the last worker's load),
``seconds_one_link`` (one whole transfer over one shaped link, measured first in the
same run, by one receiver alone), ``node_extra_mem_per_model`` (on the busiest
receiving host: its shared-memory files plus every process's private memory growth
during the version, over the model's bytes), ``link_utilization`` (the one-link
transfer's rate over R) and ``cores_busy`` (this machine's busy fraction during the
version: near 1.0 says the 2 cores, not the links, were the bound); ``sync_retries``
counts workers' syncs that failed and were tried again (as the coordinator would).

``--wake-after S``: the shards sleep while each version is published and wake S seconds
later (a sleeping shard syncs at its wake); per version also ``seconds_wake_to_all``
(from the wake to the last worker's load) and ``nodes_holding_at_wake`` (node caches
that had received the version by then: with prefetch, every one; ``--no-prefetch``,
none). ``--streams S`` is the owner's tcp streams per transfer (``weights.streams``).
``--fault kill-relay|link-down`` strikes in each timed version (``bench/weights_faults.py``);
every run reports ``torn_loads`` (workers that found part of another version in what
they loaded: must be 0) and, with node caches, ``seconds_nodes_hold`` (from publishing
to the last node's cache holding the version). A host's receiver is started again when
it dies, as ``launch --node`` does.

``--delta F``: versions as a training step makes them, a fraction F of the elements
moving (the same elements each version: 0.5 elsewhere, the version's number there), and
the owner serving deltas (``weights.delta: auto``, ``weights/delta_source.py``). Per
version also ``owner_egress_bytes``; overall ``seconds_nodes_hold_over_bound``: the
time for every node to hold it over (the bytes that left the owner + one encoded bucket
per hop) / the link rate.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rlix_async.bench.hosts import Hosts, make_hosts, shape_link, tx_bytes
from rlix_async.bench.weights import _rss_anon
from rlix_async.bench.weights_cluster_roles import MIB, PIPELINE, WAIT_S, _wait_for
from rlix_async.bench.weights_faults import NodeLogs, inject

# --- the driver -------------------------------------------------------------------------


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        parts = [int(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as fh:
                todo += [int(c) for c in fh.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def _shm_bytes(pid: int) -> int:
    """Bytes in the shared-memory directory of ``pid``'s host (its mount namespace)."""
    root = Path(f"/proc/{pid}/root/dev/shm")
    try:
        return sum(p.stat().st_blocks * 512 for p in root.iterdir() if p.is_file())
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return 0


class HostMemory:
    """Peak extra memory on one host while the block runs: its shared-memory files (a
    node cache's slots, whole) plus every process's private memory growth over what it
    held when the block began (the workers' own model tensors are not extra)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _now(self) -> tuple[int, int]:
        procs = [q for p in self.pids for q in _descendants(p)]
        return _shm_bytes(self.pids[0]), sum(_rss_anon(p) for p in procs)

    def __enter__(self) -> HostMemory:
        shm, self.base = self._now()
        self.peak = shm
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            shm, anon = self._now()
            self.peak = max(self.peak, shm + max(0, anon - self.base))
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_cluster_bench(
    hosts_n: int,
    shards_per_host: int,
    tp: int,
    link_mbit: int,
    *,
    model_mb: int = 256,
    bucket_mb: int = 64,
    transport: str = "sealed",
    path: str = "node",
    versions: int = 3,
    relay: bool = True,
    streams: int = 2,
    wake_after_s: float = 0.0,
    prefetch: bool = True,
    fault: str = "",
    delta: float = 0.0,
    work: Path | None = None,
) -> dict[str, Any]:
    """The figures of one configuration (see the module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix="rlix-bench-", dir=work))
    shape = Shape(hosts_n, shards_per_host, tp, link_mbit, model_mb, bucket_mb, transport,
                  path, versions, relay, streams, wake_after_s, prefetch, fault, delta)  # fmt: skip
    try:
        return _run(tmp, shape)
    finally:
        _remove(tmp)


@dataclass(frozen=True)
class Shape:
    """One configuration of the benchmark (the CLI's options)."""

    hosts: int
    shards_per_host: int
    tp: int
    link_mbit: int
    model_mb: int
    bucket_mb: int
    transport: str
    path: str
    versions: int
    relay: bool
    streams: int
    wake_after_s: float  # > 0: the shards sleep while a version is published, then wake
    prefetch: bool  # the node caches take each version as published (weights.prefetch)
    fault: str = ""  # one of bench/weights_faults.FAULTS, struck in each timed version
    delta: float = 0.0  # > 0: this fraction of the elements moves per version, as deltas


def _run(tmp: Path, shape: Shape) -> dict[str, Any]:
    from rlix_async.security import keygen

    d = tmp / "exchange"
    d.mkdir()
    keys = tmp / "keys"
    keygen(keys, [f"driver-{PIPELINE}"], role="driver", pipelines=[PIPELINE])
    keygen(keys, ["shard"], role="shard", pipelines=[PIPELINE])
    py = [sys.executable, "-m", "rlix_async.bench.weights_cluster_roles"]
    logs = tmp / "logs"
    logs.mkdir()
    first_timed = 3  # version 1: the one-link probe; 2: warm-up (allocations, connections)
    last = first_timed + shape.versions - 1
    with make_hosts(shape.hosts + 1, tmp / "hosts") as hosts:
        for h in hosts.hosts:
            shape_link(h, shape.link_mbit)
        hosts.start(
            hosts[0],
            [*py, "owner", str(d), str(keys), hosts[0].address, str(shape.model_mb),
             str(shape.bucket_mb), shape.transport, str(shape.streams), str(shape.delta)],
            logs / "owner.log",
        )  # fmt: skip
        model_bytes = _model_bytes(shape.model_mb)
        # one whole transfer over one shaped link, one receiver alone (no node cache yet)
        probe = hosts.start(
            hosts[1], [*py, "worker", str(d), str(keys), "probe", "0", "1", "1", "1", "awake"],
            logs / "probe.log",
        )  # fmt: skip
        (d / "go-1").touch()
        _wait_for(d / "done-1-probe.json")
        probe.wait(60)
        one_link = msgspec.json.decode((d / "done-1-probe.json").read_bytes())["seconds"]
        per_host, names = _start_hosts(hosts, d, keys, logs, shape, last)
        if shape.path == "node":
            _wait_receivers(hosts, logs, shape.hosts)
        rows = []
        for version in range(2, last + 1):
            timed = version >= first_timed
            row = _one_version(
                hosts, d, logs, per_host, names, version, model_bytes, shape, strike=timed
            )
            if timed:
                rows.append(row)
        (d / "stop").touch()
        hosts.stop()
    # per host, how many times its receiver started (1: never restarted)
    starts = {
        i: (logs / f"node-cache-{i}.log").read_bytes().count(b"READY node-cache")
        for i in range(1, shape.hosts + 1)
        if (logs / f"node-cache-{i}.log").exists()
    }
    return _summary(shape, rows, starts, one_link, model_bytes)


def _summary(
    shape: Shape,
    rows: list[dict[str, Any]],
    starts: dict[int, int],
    one_link: float,
    model_bytes: int,
) -> dict[str, Any]:
    """The run's figures: the shape, the timed versions and their medians."""
    result: dict[str, Any] = {
        "hosts": shape.hosts,
        "shards_per_host": shape.shards_per_host,
        "tp": shape.tp,
        "link_mbit": shape.link_mbit,
        "transport": shape.transport,
        "streams": shape.streams,
        "path": shape.path,
        "relay": shape.relay and shape.path == "node",
        "wake_after_s": shape.wake_after_s,
        "prefetch": shape.prefetch and shape.path == "node",
        "fault": shape.fault,
        "receiver_starts": starts,
        "model_mb": round(model_bytes / MIB, 1),
        "seconds_one_link": round(one_link, 3),
        "link_utilization": round(model_bytes * 8 / one_link / (shape.link_mbit * 1e6), 3),
        "versions": rows,
    }
    keys_ = ["owner_egress_per_model", "seconds_to_all", "node_extra_mem_per_model", "cores_busy"]
    keys_ += ["seconds_nodes_hold"] if shape.path == "node" else []
    if shape.wake_after_s:
        keys_.append("seconds_wake_to_all")
    for key in keys_:
        result[key] = round(statistics.median(r[key] for r in rows), 3)
    result["seconds_to_all_over_one_link"] = round(result["seconds_to_all"] / one_link, 3)
    if shape.delta and shape.path == "node":
        result["delta"] = shape.delta
        result["owner_egress_bytes"] = statistics.median(r["owner_egress_bytes"] for r in rows)
        # the bytes that left the owner at the link's rate, and one encoded bucket per hop
        rate = shape.link_mbit * 1e6 / 8
        buckets = -(-model_bytes // (shape.bucket_mb * MIB))
        wire = result["owner_egress_bytes"]
        bound = wire / rate + shape.hosts * (wire / buckets) / rate
        result["seconds_nodes_hold_bound"] = round(bound, 3)
        result["seconds_nodes_hold_over_bound"] = round(result["seconds_nodes_hold"] / bound, 3)
    return result


def _start_hosts(
    hosts: Hosts, d: Path, keys: Path, logs: Path, shape: Shape, last: int
) -> tuple[dict[int, list[int]], list[str]]:
    """Each receiving host's receiver (node path) and workers; their pids per host, and
    the workers' names. A host's processes start from one shell on it: they share its
    /dev/shm only when they share its mount namespace (each start makes a new one)."""
    py = [sys.executable, "-m", "rlix_async.bench.weights_cluster_roles"]
    per_host: dict[int, list[int]] = {}
    names = []
    asleep = "asleep" if shape.wake_after_s else "awake"
    for i in range(1, len(hosts.hosts)):
        commands = []
        if shape.path == "node":
            receiver = [sys.executable, "-m", "rlix_async.cli", "node-cache"]
            receiver += ["--pipeline", PIPELINE, "--keys", str(keys)]
            receiver += ["--address", hosts[i].address] if shape.relay else []
            receiver += [] if shape.prefetch else ["--no-prefetch"]
            # started again when it dies, as `launch --node` does (same host, same /dev/shm)
            stop, log = shlex.quote(str(d / "stop")), shlex.quote(str(logs / f"node-cache-{i}.log"))
            supervised = f"while [ ! -e {stop} ]; do {shlex.join(receiver)} >>{log} 2>&1; "
            supervised += "sleep 0.2; done"
            commands.append((["sh", "-c", supervised], logs / f"host-{i}-receiver.log"))
        for s in range(shape.shards_per_host):
            for r in range(shape.tp):
                name = f"h{i}s{s}r{r}"
                names.append(name)
                argv = [*py, "worker", str(d), str(keys), name, str(r), str(shape.tp), "2",
                        str(last), asleep]  # fmt: skip
                commands.append((argv, logs / f"worker-{name}.log"))
        script = " ".join(
            f"{shlex.join(argv)} >{shlex.quote(str(log))} 2>&1 &" for argv, log in commands
        )
        shell = hosts.start(hosts[i], ["sh", "-c", script + " wait"], logs / f"host-{i}.log")
        per_host[i] = [shell.pid]
    return per_host, names


def _one_version(
    hosts: Hosts,
    d: Path,
    logs: Path,
    per_host: dict[int, list[int]],
    names: list[str],
    version: int,
    model_bytes: int,
    shape: Shape,
    strike: bool = False,
) -> dict[str, Any]:
    """Publish ``version`` and measure it reaching every worker (asleep: woken
    ``wake_after_s`` after it was published; ``strike``: with the shape's fault)."""
    sent0 = tx_bytes(hosts[0])
    busy0, total0 = _cpu_times()
    memories = [HostMemory(pids) for pids in per_host.values()]
    for m in memories:
        m.__enter__()
    woken, ready_at_wake = 0.0, 0
    watch = NodeLogs(logs, shape.hosts, PIPELINE).__enter__()
    faulted: dict[str, object] = {}
    striker, struck_out = None, []
    if strike and shape.fault:

        def strike_now() -> None:
            try:
                faulted.update(inject(shape.fault, hosts, watch, version, WAIT_S))
            except BaseException as exc:  # raised in the driver below, not lost
                struck_out.append(exc)

        striker = threading.Thread(target=strike_now, daemon=True)
        striker.start()
    try:
        (d / f"go-{version}").touch()
        if shape.wake_after_s:
            _wait_for(d / f"ref-{version}.json")
            time.sleep(shape.wake_after_s)
            woken = time.time()
            ready_at_wake = len(watch.received(version))
            (d / f"wake-{version}").touch()
        for name in names:
            _wait_for(d / f"done-{version}-{name}.json")
        if shape.path == "node":  # every node's cache holds it (a killed one's successor)
            _wait_until(lambda: len(watch.received(version)) == shape.hosts)
        if striker is not None:
            striker.join(WAIT_S)
            if struck_out:
                raise RuntimeError(f"the fault {shape.fault} failed: {struck_out[0]}")
    finally:
        watch.__exit__()
        for m in memories:
            m.__exit__()
    busy1, total1 = _cpu_times()
    published = msgspec.json.decode((d / f"ref-{version}.json").read_bytes())["published"]
    done = [msgspec.json.decode((d / f"done-{version}-{n}.json").read_bytes()) for n in names]
    row = {
        "version": version,
        "owner_egress_per_model": (tx_bytes(hosts[0]) - sent0) / model_bytes,
        "owner_egress_bytes": tx_bytes(hosts[0]) - sent0,
        "seconds_to_all": max(x["done"] for x in done) - published,
        "node_extra_mem_per_model": max(m.peak for m in memories) / model_bytes,
        "worker_staged_bytes": max(x["staged_bytes"] for x in done),
        "sync_retries": sum(x["retries"] for x in done),
        "cores_busy": (busy1 - busy0) / max(1, total1 - total0),
    }
    if shape.wake_after_s:
        row["seconds_wake_to_all"] = max(x["done"] for x in done) - woken
        row["nodes_holding_at_wake"] = ready_at_wake
    row["torn_loads"] = sum(1 for x in done if x["torn"])
    if shape.path == "node":
        held = {i: round(at - published, 3) for i, at in sorted(watch.received(version).items())}
        row["seconds_nodes_hold"] = max(held.values())
        row["seconds_each_node_holds"] = held  # per host: a fault's victim and the others
    if faulted:
        row["fault"] = {**faulted, "at": round(float(faulted["at"]) - published, 3)}  # type: ignore[arg-type]
    return row


def _wait_until(done: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s")
        time.sleep(0.02)


def _model_bytes(model_mb: int) -> int:
    from rlix_async.bench.weights import model_like

    return sum(t.numel() * t.element_size() for t in model_like(model_mb * MIB).values())


def _wait_receivers(hosts: Hosts, logs: Path, n: int) -> None:
    for i in range(1, n + 1):
        log = logs / f"node-cache-{i}.log"
        deadline = time.monotonic() + 60
        while b"READY" not in (log.read_bytes() if log.exists() else b""):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the receiver on host {i} did not start: {log}")
            time.sleep(0.05)


def _remove(tmp: Path) -> None:
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
