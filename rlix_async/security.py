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


@dataclass(frozen=True)
class Principal:
    """Who holds a client key: its name, role and the pipelines it may act for."""

    name: str
    role: str  # one of ROLES
    pipelines: frozenset[str] | None = None  # None: every pipeline

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
            principals[public] = parse_role(role_file.read_text(), name)
        return cls(principals)

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
) -> list[Path]:
    """Create the server key pair (if absent) and one key pair per client name, each
    allowed ``role`` (for ``pipelines``; None or ``["*"]``: any). A client that
    exists keeps its key; its role is written only where it has none."""
    text = role if role == "admin" else f"{role} {','.join(pipelines or [ANY])}"
    parse_role(text)  # refuse a bad role before writing anything
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
    return written
