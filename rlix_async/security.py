"""Who may talk to the coordinator.

- ``ipc://`` sockets live in a directory that only the current user can enter
  (mode 0700, owned by us), so file permissions are the authentication.
- ``tcp://`` endpoints always use ZMQ CURVE: the server proves its identity with
  its key pair and accepts only clients whose public key is in ``authorized/``.
  An unauthenticated peer fails the handshake and never reaches the application.
  (Bulk weight bytes leave through a plain socket, sealed with a key granted over
  CURVE: see ``weights/stream.py``.)

Key directory layout (``rlix-async keygen DIR``)::

    DIR/server.key  DIR/server.key_secret     coordinator's key pair
    DIR/client.key  DIR/client.key_secret     a client key pair (more with --client NAME)
    DIR/authorized/client.key                 public keys the server accepts
    DIR/authorized/client.role                what that key may do: one line,
                                              ``admin``, ``driver PIPELINES`` or
                                              ``shard PIPELINES`` (``*``: any)
    DIR/authorized/driver-a.allow             what a driver key may hold (optional):
                                              ``devices 0-15``, ``max_weight 4``,
                                              ``max_priority ACTOR_TRAINING``,
                                              ``groups g1,g2``, one per line

All files are 0600 and directories 0700. Give each node only the secret keys its
processes use (the coordinator's node: ``server``; a shard host: ``shard-HOST``
or ``shard``; a trainer node: ``driver-ID``), with ``server.key`` and
``authorized/`` everywhere.

Authorization: every message a tcp peer sends carries its CURVE public key (ZMQ's
``User-Id``); the server binds the peer's identity to that key at hello and
refuses any message from another key. A key's role decides which identities it
may take (:meth:`Principal.may_use`): a driver key only ``P/driver/0`` and
``P/router/*`` of its pipelines, a shard key only ``P/infer/*`` and
``P/weights/*``, an admin key (the CLI) any. Handlers then act only for the
pipeline the caller's identity names. On ipc:// there are no keys: every local
peer is the same user, and only the identity rules apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import zmq
import zmq.auth

log = logging.getLogger(__name__)

SERVER_CERT = "server"
DEFAULT_CLIENT = "client"
AUTHORIZED = "authorized"
ROLES = ("admin", "driver", "shard")
ANY = "*"


class SecurityError(RuntimeError):
    """An endpoint or key directory that would let other users in."""


def _ensure_private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise SecurityError(f"{path} is owned by uid {st.st_uid}, not by us ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SecurityError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}; it must be private (chmod 700)"
        )
    return path


def ipc_dir() -> Path:
    """The per-user private directory for ipc sockets (created on first use)."""
    base = os.environ.get("RLIX_IPC_DIR")
    if base:
        return _ensure_private_dir(Path(base))
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(runtime) if runtime and os.path.isdir(runtime) else Path(tempfile.gettempdir())
    return _ensure_private_dir(root / f"rlix-async-{os.getuid()}")


def ipc_endpoint(name: str) -> str:
    """``ipc://`` endpoint for ``name`` inside the private directory."""
    safe = name.replace("/", "_")
    path = ipc_dir() / f"{safe}.sock"
    if len(str(path)) > 100:  # sun_path is 108 bytes on Linux
        raise SecurityError(f"ipc path too long ({len(str(path))} chars): {path}")
    return f"ipc://{path}"


def remove_ipc_file(endpoint: str) -> None:
    """Unlink a closed ``ipc://`` socket's file: libzmq 4.3 leaves it behind on close
    and unbind, and a long-lived host would collect thousands of them."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint[len("ipc://") :])


def parse_devices(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` as a set of device ids."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise SecurityError(f"devices {text!r}: expected ranges and lists like 0-3,8") from None
        if first < 0 or last < first:
            raise SecurityError(f"devices {text!r}: {part.strip()!r} is not a range")
        out.update(range(first, last + 1))
    return frozenset(out)


def format_devices(devices: frozenset[int]) -> str:
    """The shortest ``0-3,8`` spelling of ``devices``."""
    runs: list[list[int]] = []
    for d in sorted(devices):
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class Allowance:
    """What a driver key may hold (``authorized/NAME.allow``): the devices its
    pipelines may name, their largest fair-share weight, the most important
    non-preemptable priority they may ask for, the base groups they may join or
    create, how long one of their pipelines may hold a non-preemptable stage.
    Unset: no limit of that kind (groups: none)."""

    devices: frozenset[int] | None = None
    max_weight: float | None = None
    max_priority: str | None = None  # a priority name (protocols.topology.Priority)
    groups: frozenset[str] = frozenset()
    max_hold_s: float | None = None  # past it the pipeline is dropped, as a silent one is

    def text(self) -> str:
        lines = []
        if self.devices is not None:
            lines.append(f"devices {format_devices(self.devices)}")
        if self.max_weight is not None:
            lines.append(f"max_weight {_number(self.max_weight)}")
        if self.max_priority is not None:
            lines.append(f"max_priority {self.max_priority}")
        if self.groups:
            lines.append(f"groups {','.join(sorted(self.groups))}")
        if self.max_hold_s is not None:
            lines.append(f"max_hold {_number(self.max_hold_s)}")
        return "".join(f"{line}\n" for line in lines)


def _number(x: float) -> str:
    """As written, whole numbers without a point (``:g`` would round 1234567)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def parse_allowance(text: str, name: str = "?") -> Allowance:
    """An ``authorized/NAME.allow`` file; unknown keys and bad values are refused."""
    fields: dict[str, object] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = line.strip().partition(" ")
        value = value.strip()
        if key in fields or not value:
            raise SecurityError(f"allowance of key {name!r}: {line.strip()!r} (repeated or empty)")
        if key == "devices":
            fields[key] = parse_devices(value)
        elif key in ("max_weight", "max_hold"):
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if not number > 0:
                raise SecurityError(f"allowance of key {name!r}: {key} {value!r} (a number > 0)")
            fields["max_hold_s" if key == "max_hold" else key] = number
        elif key == "max_priority":
            fields[key] = value
        elif key == "groups":
            fields[key] = frozenset(g for g in value.split(",") if g)
        else:
            raise SecurityError(
                f"allowance of key {name!r}: unknown {key!r} "
                "(devices, max_weight, max_priority, groups, max_hold)"
            )
    return Allowance(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Principal:
    """Who holds a client key: its name, role, the pipelines it may act for and, for
    a driver key with an allowance file, what they may hold."""

    name: str
    role: str  # one of ROLES
    pipelines: frozenset[str] | None = None  # None: every pipeline
    allowance: Allowance | None = None  # None: no allowance file, no limits

    def covers(self, pipeline: str) -> bool:
        return self.pipelines is None or pipeline in self.pipelines

    def may_use(self, identity: str) -> bool:
        """Whether this key may connect under ``identity`` (``PIPELINE/KIND/INDEX``)."""
        if self.role == "admin":
            return True
        pipeline, kind, index = [*identity.split("/"), "", "", ""][:3]
        if self.role == "driver":
            if kind == "driver" and pipeline.startswith("anon-"):
                return self.pipelines is None  # asks the coordinator for a fresh id
            if kind == "driver":  # one driver per pipeline: a second one is refused
                return index == "0" and self.covers(pipeline)
            return kind == "router" and self.covers(pipeline)
        if self.role == "shard":
            return kind in ("infer", "weights") and self.covers(pipeline)
        return False

    def describe(self) -> str:
        scope = (
            ""
            if self.role == "admin"
            else " for "
            + ("any pipeline" if self.pipelines is None else ", ".join(sorted(self.pipelines)))
        )
        return f"key {self.name!r} ({self.role}{scope})"


def parse_role(text: str, name: str = "?") -> Principal:
    """``admin`` | ``driver P1,P2`` | ``shard *``: one line, as in ``NAME.role``."""
    words = text.split()
    if not words or words[0] not in ROLES:
        raise SecurityError(
            f"role of key {name!r} is {text.strip()!r}: expected one of {', '.join(ROLES)}"
        )
    role = words[0]
    if role == "admin":
        if len(words) > 1:
            raise SecurityError(f"role of key {name!r}: admin takes no pipelines")
        return Principal(name, role)
    if len(words) != 2:
        raise SecurityError(
            f"role of key {name!r}: {role} needs its pipelines (comma-separated, or *)"
        )
    pipelines = None if words[1] == ANY else frozenset(p for p in words[1].split(",") if p)
    return Principal(name, role, pipelines)


class AccessList:
    """The keys a server accepts (``DIR/authorized``) and what each may do."""

    def __init__(self, principals: dict[bytes, Principal]) -> None:
        self.principals = principals  # z85 public key -> its principal

    @classmethod
    def load(cls, authorized: Path) -> AccessList:
        principals: dict[bytes, Principal] = {}
        for key_file in sorted(authorized.glob("*.key")):
            name = key_file.stem
            role_file = key_file.with_suffix(".role")
            if not role_file.exists():
                raise SecurityError(
                    f"{key_file} has no {role_file.name}: say what it may do with "
                    f"`rlix-async keygen DIR --client {name} --role admin|driver|shard`"
                )
            public, _ = zmq.auth.load_certificate(str(key_file))
            principal = parse_role(role_file.read_text(), name)
            allow_file = key_file.with_suffix(".allow")
            if allow_file.exists():
                if principal.role != "driver":
                    raise SecurityError(f"{allow_file}: only driver keys have allowances")
                principal = dataclasses.replace(
                    principal, allowance=parse_allowance(allow_file.read_text(), name)
                )
            principals[public] = principal
        return cls(principals)

    @staticmethod
    def signature(authorized: Path) -> tuple[tuple[str, int, int], ...]:
        """What changes when a key is added, revoked or given another role or
        allowance (names, sizes, modification times)."""
        return tuple(
            sorted((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in authorized.iterdir())
        )

    def principal(self, user_id: bytes | str | None) -> Principal | None:
        if user_id is None:
            return None
        key = user_id.encode() if isinstance(user_id, str) else user_id
        return self.principals.get(key)


def check_endpoint(endpoint: str, keys: ServerKeys | ClientKeys | None) -> None:
    """Refuse endpoints that other users could reach without authenticating."""
    scheme = endpoint.split("://", 1)[0]
    if scheme == "ipc":
        _ensure_private_dir(Path(endpoint[len("ipc://") :]).parent)
    elif scheme == "tcp":
        if keys is None:
            raise SecurityError(
                f"{endpoint}: tcp endpoints need CURVE keys; create them with "
                "`rlix-async keygen DIR` and set keys=DIR (library: ServerKeys/ClientKeys.load(DIR))"
            )
    else:
        raise ValueError(f"unsupported endpoint {endpoint!r}: use ipc:// or tcp://")


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_dir: Path
    access: AccessList

    @classmethod
    def load(cls, keys_dir: str | Path, name: str = SERVER_CERT) -> ServerKeys:
        """The coordinator's pair (``server``); a shard's data plane serves with its
        own client pair (``name``), so only the coordinator holds the server secret."""
        d = Path(keys_dir)
        _check_key_dir(d)
        public, secret = _load_pair(d / f"{name}.key_secret")
        authorized = d / AUTHORIZED
        if not any(authorized.glob("*.key")):
            raise SecurityError(f"{authorized} holds no public keys: nobody could connect")
        return cls(public, secret, authorized, AccessList.load(authorized))

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, keys_dir: str | Path, name: str = DEFAULT_CLIENT) -> ClientKeys:
        d = Path(keys_dir)
        _check_key_dir(d)
        public, secret = _load_pair(d / f"{name}.key_secret")
        server_public, _ = zmq.auth.load_certificate(str(d / f"{SERVER_CERT}.key"))
        return cls(public, secret, server_public)

    @classmethod
    def load_first(cls, keys_dir: str | Path, *names: str) -> tuple[str, ClientKeys]:
        """The first of ``names`` whose secret key this node holds (a process's own
        key, e.g. ``driver-ID``, before the shared fallback ``client``)."""
        d = Path(keys_dir)
        for name in names:
            if (d / f"{name}.key_secret").exists():
                if name == DEFAULT_CLIENT and names[0] != DEFAULT_CLIENT:
                    log.warning(
                        "no %s key in %s: using the shared %r key (an admin key on most "
                        "setups; see rlix-async keygen --role)",
                        names[0],
                        d,
                        DEFAULT_CLIENT,
                    )
                return name, cls.load(d, name)
        raise SecurityError(
            f"{d} holds none of the keys {', '.join(names)} (run `rlix-async keygen`)"
        )

    def for_server(self, server_public: bytes) -> ClientKeys:
        """The same pair, talking to another server (a shard's data plane)."""
        return ClientKeys(self.public, self.secret, server_public)

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


_Keys = TypeVar("_Keys", ServerKeys, ClientKeys)


def tcp_only(endpoint: str, keys: _Keys | None) -> _Keys | None:
    """The keys a socket on ``endpoint`` uses: CURVE on tcp only. On ipc the private
    directory is the authentication, and a peer holding keys (a router, a trainer on
    a node whose coordinator is on tcp) must not speak CURVE to a keyless ipc peer."""
    return keys if endpoint.startswith("tcp://") else None


def _load_pair(secret_file: Path) -> tuple[bytes, bytes]:
    if not secret_file.exists():
        raise SecurityError(f"missing key file {secret_file} (run `rlix-async keygen`)")
    mode = stat.S_IMODE(secret_file.stat().st_mode)
    if mode & 0o077:
        raise SecurityError(f"{secret_file} has mode {mode:o}; secret keys must be 0600")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise SecurityError(f"{secret_file} holds no secret key")
    return public, secret


def _check_key_dir(d: Path) -> None:
    if not d.is_dir():
        raise SecurityError(f"key directory {d} does not exist (run `rlix-async keygen {d}`)")
    _ensure_private_dir(d)


def keygen(
    keys_dir: str | Path,
    clients: list[str] | None = None,
    role: str = "admin",
    pipelines: list[str] | None = None,
    allowance: Allowance | None = None,
) -> list[Path]:
    """Create the server key pair (if absent) and one key pair per client name, each
    allowed ``role`` (for ``pipelines``; None or ``["*"]``: any). A client that
    exists keeps its key; its role is written only where it has none; an
    ``allowance`` (driver keys only) is written, or replaced, whenever given."""
    text = role if role == "admin" else f"{role} {','.join(pipelines or [ANY])}"
    parse_role(text)  # refuse a bad role before writing anything
    if allowance is not None and role != "driver":
        raise SecurityError("allowances (--devices, --max-weight, ...) are for driver keys")
    for name in clients or []:
        if not name or name == SERVER_CERT or not name.replace("-", "").replace("_", "").isalnum():
            raise SecurityError(f"bad key name {name!r}: letters, digits, - and _ only")
    d = _ensure_private_dir(Path(keys_dir))
    authorized = _ensure_private_dir(d / AUTHORIZED)
    written: list[Path] = []
    names = [SERVER_CERT] if not (d / f"{SERVER_CERT}.key_secret").exists() else []
    wanted = clients or [DEFAULT_CLIENT]
    names += [n for n in wanted if not (d / f"{n}.key_secret").exists()]
    for name in names:
        public_file, secret_file = zmq.auth.create_certificates(str(d), name)
        for f in (public_file, secret_file):
            os.chmod(f, 0o600)
            written.append(Path(f))
        if name != SERVER_CERT:
            dst = authorized / f"{name}.key"
            shutil.copyfile(public_file, dst)
            os.chmod(dst, 0o600)
            written.append(dst)
    for name in wanted:
        role_file = authorized / f"{name}.role"
        if not role_file.exists():
            role_file.write_text(text + "\n")
            os.chmod(role_file, 0o600)
            written.append(role_file)
        if allowance is not None:
            allow_file = authorized / f"{name}.allow"
            tmp = allow_file.with_suffix(".allow.tmp")
            tmp.write_text(allowance.text())
            os.chmod(tmp, 0o600)
            os.replace(tmp, allow_file)  # a coordinator reloading now reads old or new
            written.append(allow_file)
    return written


def revoke(keys_dir: str | Path, name: str) -> list[Path]:
    """Remove client key ``name``: the server no longer accepts it (a running
    coordinator notices within seconds and drops its peers) and its pair is deleted
    from this directory. Returns what was removed."""
    if name == SERVER_CERT:
        raise SecurityError("the server's own key cannot be revoked (make a new directory)")
    d = Path(keys_dir)
    _check_key_dir(d)
    authorized = d / AUTHORIZED
    if not (authorized / f"{name}.key").exists():
        raise SecurityError(f"{authorized} holds no key {name!r}")
    removed = []
    # the public key first: from then on a reloading server refuses it
    for path in [authorized / f"{name}.{ext}" for ext in ("key", "role", "allow")] + [
        d / f"{name}.key",
        d / f"{name}.key_secret",
    ]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
