"""Faults for ``rlix-async bench weights --hosts N --fault F``, injected while a version
crosses to the hosts, and what the driver watches to time them.

- ``kill-relay``: as soon as a node's receiver reports it pulls the version from
  another node's relay, that relay's receiver is killed (SIGKILL: no goodbye). The
  node behind it must take the version from the owner; the killed receiver's host
  runs it again (as ``launch --node`` restarts it) and its successor takes the
  version too.
- ``link-down``: as soon as the last host's receiver begins its pull, its link goes
  down for ``LINK_DOWN_S`` (the bridge's end of its veth), then up: it must catch up
  without any process being restarted.

Either way no worker may load part of a version (each checks every tensor it holds
against the version's value), and the run reports when every node's cache held it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from rlix_async.bench.hosts import Host, Hosts

FAULTS = ("kill-relay", "link-down")
LINK_DOWN_S = 10.0
WATCH_S = 0.02


class NodeLogs:
    """Polls the hosts' receiver logs (``node-cache-I.log``) on a thread and keeps when
    each line of interest first appeared: a pull begun (and from where), a version
    received."""

    def __init__(self, logs: Path, hosts: int, pipeline: str) -> None:
        self.paths = {i: logs / f"node-cache-{i}.log" for i in range(1, hosts + 1)}
        self.pipeline = pipeline
        self._seen: dict[tuple[int, str], float] = {}
        self._read: dict[int, int] = dict.fromkeys(self.paths, 0)  # bytes read so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> NodeLogs:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            now = time.time()
            for i, path in self.paths.items():
                with contextlib.suppress(OSError), path.open("rb") as fh:
                    fh.seek(self._read[i])
                    new = fh.read()
                    whole = new[: new.rfind(b"\n") + 1]  # only whole lines: the rest later
                    self._read[i] += len(whole)
                    for line in whole.decode(errors="replace").splitlines():
                        self._seen.setdefault((i, line), now)

    def first(self, pattern: str) -> dict[int, tuple[float, str]]:
        """Per host, the first line matching ``pattern`` (a regex) and when it appeared."""
        out: dict[int, tuple[float, str]] = {}
        for (i, line), at in sorted(self._seen.items(), key=lambda kv: kv[1]):
            if i not in out and re.search(pattern, line):
                out[i] = (at, line)
        return out

    def received(self, version: int) -> dict[int, float]:
        got = self.first(rf"^received version {version} of {re.escape(self.pipeline)}:")
        return {i: at for i, (at, _) in got.items()}


def node_cache_pids(host: Host) -> list[int]:
    """The node cache (weights receiver) processes on ``host``: none while whoever
    starts it starts a new one."""
    pids = subprocess.run(
        ["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30
    ).stdout.split()
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            # the receiver's python, not the shell that starts it again
            if b"node-cache" in cmd and os.path.basename(cmd[0]) != b"sh":
                out.append(int(pid))
    return out


def inject(
    fault: str, hosts: Hosts, watch: NodeLogs, version: int, timeout: float
) -> dict[str, object]:
    """Wait for the moment ``fault`` strikes in ``version``'s crossing, strike, and say
    what was done (host, when). Runs on a thread of the driver."""
    deadline = time.monotonic() + timeout
    pulling = rf"^pulling version {version} of {re.escape(watch.pipeline)} from "
    while time.monotonic() < deadline:
        begun = watch.first(pulling)
        if fault == "kill-relay":
            for _, line in begun.values():
                match = re.search(r"from tcp://([0-9.]+):", line)
                if match is None:
                    continue
                relay = next(h for h in hosts.hosts if h.address == match.group(1))
                pids = node_cache_pids(relay)
                if not pids:
                    raise RuntimeError(f"kill-relay: no receiver runs on {relay.name}")
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return {"fault": fault, "host": relay.index, "at": time.time(), "pids": pids}
        elif len(hosts.hosts) - 1 in begun:
            last = hosts[len(hosts.hosts) - 1]
            at = time.time()
            subprocess.run(["ip", "link", "set", last.veth, "down"], check=True, timeout=30)
            time.sleep(LINK_DOWN_S)
            subprocess.run(["ip", "link", "set", last.veth, "up"], check=True, timeout=30)
            return {"fault": fault, "host": last.index, "at": at, "seconds": LINK_DOWN_S}
        time.sleep(WATCH_S)
    raise TimeoutError(f"{fault}: its moment never came in version {version}")
