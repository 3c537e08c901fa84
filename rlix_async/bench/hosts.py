"""Hosts on one machine, in network namespaces: the multi-node test tier
(``-m multinode``) and ``rlix-async bench weights --hosts N`` run on them.

Each host is a network namespace joined to a private bridge by a veth pair, with an
address of our own (``10.X.Y.1+i/24``) and loopback, and every process started on it
runs in its own UTS and mount namespace as well: its own hostname (``hostI``) and
its own ``/dev/shm``, so a trainer's weight segments are invisible to another host's
shards exactly as on separate machines, and ipc sockets live in a per-host
directory. The file system is otherwise shared, as a cluster's shared storage is.
Traffic goes only to loopback and these namespaces' own addresses (no route leaves
the bridge). Needs root (as on this machine kind and in CI); where namespaces cannot
be made, :func:`make_hosts` raises :class:`HostsError` with the reason (the test tier
fails with it: never a silent skip). :func:`shape_link` limits a host's link in both
directions with ``tc`` (a token bucket on each end of its veth pair;
:func:`unshape_link` lifts it), and
:func:`tx_bytes` reads what a host sent, from the kernel's counters.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

# Runs inside `ip netns exec NS unshare --uts --mount`: name the host, give it a /dev/shm
# of its own and an /etc/hosts that resolves every host's name to its address (torchrun
# and gloo resolve their own hostname), then become the command.
_ENTER = (
    'hostname "$RLIX_TEST_HOSTNAME" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && '
    'mount --bind "$RLIX_TEST_HOSTS_FILE" /etc/hosts && exec "$@"'
)


class HostsError(RuntimeError):
    """Namespaces, links or shaping could not be set up here (one line)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _on(host: Host, argv: Sequence[str]) -> list[str]:
    """``argv`` inside ``host``: its network, then its own hostname and /dev/shm."""
    return [
        "ip", "netns", "exec", host.netns,
        "unshare", "--uts", "--mount", "--propagation", "private",
        "sh", "-c", _ENTER, "sh", *argv,
    ]  # fmt: skip


def _veth(tag: str, index: int) -> str:
    return f"rlixt{tag}v{index}"


@dataclass
class Host:
    index: int
    netns: str
    address: str
    root: Path  # its private files (the hosts file)
    ipc: Path  # its ipc sockets: a short path, as /run/user/<uid> is on a real host
    veth: str  # the bridge's end of its link (the host's end is its eth0)

    @property
    def name(self) -> str:
        return f"host{self.index}"


@dataclass
class Hosts:
    hosts: list[Host]
    bridge: str
    procs: list[tuple[Host, subprocess.Popen[bytes], IO[bytes]]] = field(default_factory=list)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def env(self, host: Host) -> dict[str, str]:
        host.root.mkdir(parents=True, exist_ok=True)
        names = host.root / "hosts"
        names.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        )
        return {
            "RLIX_TEST_HOSTS_FILE": str(names),
            **os.environ,
            "RLIX_TEST_HOSTNAME": host.name,
            "RLIX_IPC_DIR": str(host.ipc),
            # vLLM and gloo look for "their" address: the namespace's own, never a probe
            "VLLM_HOST_IP": host.address,
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, host: Host, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (its network, hostname and /dev/shm)."""
        out = open(log, "ab")  # noqa: SIM115 (closed in stop)
        cmd = _on(host, argv)
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(host), start_new_session=True
        )
        self.procs.append((host, proc, out))
        return proc

    def run(self, host: Host, argv: Sequence[str], timeout: float = 60) -> str:
        """Run ``argv`` on ``host`` to the end; its output."""
        cmd = _on(host, argv)
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=self.env(host), timeout=timeout
        )
        return done.stdout + done.stderr

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILL every process in ``host``'s namespace (a machine that lost power)."""
        pids = subprocess.run(
            ["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        return [int(p) for p in pids]

    def stacks(self) -> list[str]:
        """Python stacks of every launcher and trainer on the hosts, for a test that
        timed out (needs py-spy on PATH or next to this Python; else nothing)."""
        import shutil
        import sys

        spy = shutil.which("py-spy") or shutil.which(
            "py-spy", path=str(Path(sys.executable).parent)
        )
        if spy is None:
            return []
        dumps = []
        for host in self.hosts:
            pids = subprocess.run(
                ["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                    if "rlix_async" in cmd and ("launch" in cmd or "pipeline" in cmd):
                        dump = subprocess.run(
                            [spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60
                        )
                        dumps.append(f"--- {host.name} {pid}: {cmd[:160]}\n{dump.stdout}")
        return dumps

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM what we started, then SIGKILL whatever is left in any namespace."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc, _ in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for host in self.hosts:
            self.kill_host(host)
        for _, proc, out in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            out.close()

    def remove(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", host.netns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "delete", self.bridge)


@contextlib.contextmanager
def make_hosts(n: int, root: Path) -> Iterator[Hosts]:
    """``n`` hosts on a private bridge; everything is removed on exit."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
    # ipc sockets under a short temporary directory: a socket path has 107 bytes, and
    # pytest's tmp_path (deeper still under pytest-xdist) leaves too few of them
    ipc = Path(tempfile.mkdtemp(prefix="rlixt-"))
    hosts = Hosts(
        [
            Host(
                i,
                f"rlixt{tag}h{i}",
                f"{subnet}.{i + 1}",
                root / f"host{i}",
                ipc / f"h{i}",
                _veth(tag, i),
            )
            for i in range(n)
        ],
        f"rlixt{tag}br",
    )
    for h in hosts.hosts:
        h.ipc.mkdir(mode=0o700)
    try:
        _ip("link", "add", hosts.bridge, "type", "bridge")
        _ip("link", "set", hosts.bridge, "up")
        for h in hosts.hosts:
            veth = h.veth
            _ip("netns", "add", h.netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", veth, "master", hosts.bridge, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as exc:
        hosts.remove()
        detail = getattr(exc, "stderr", "") or str(exc)
        raise HostsError(f"network namespaces (root, iproute2): {detail.strip()}") from None
    try:
        yield hosts
    finally:
        hosts.stop()
        hosts.remove()
        shutil.rmtree(ipc, ignore_errors=True)


def shape_link(host: Host, mbit: int) -> None:
    """Limit ``host``'s link to ``mbit`` Mbit/s each way: a token bucket (tc tbf) on its
    eth0 (what it sends) and on the bridge's end of its veth (what it receives)."""
    rate = f"{mbit}mbit"
    # a burst of 4 ms at the rate (at least 64 KiB, as tbf needs one MTU and timer slack)
    burst = str(max(64 << 10, mbit * 1_000_000 // 8 // 250))
    tbf = ["tbf", "rate", rate, "burst", burst, "latency", "50ms"]
    try:
        _ip("netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf)
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", host.veth, "root", *tbf],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise HostsError(f"shaping {host.name}'s link with tc: {detail.strip()}") from None


def unshape_link(host: Host) -> None:
    """Undo :func:`shape_link`: ``host``'s link at full speed again."""
    for argv in (
        ["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
        ["tc", "qdisc", "del", "dev", host.veth, "root"],
    ):
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def tx_bytes(host: Host) -> int:
    """Bytes ``host`` has sent on its link (its eth0's kernel counter)."""
    out = subprocess.run(
        ["ip", "netns", "exec", host.netns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout)
