"""Who may talk to the coordinator.

- ``ipc://`` sockets live in a directory that only the current user can enter
  (mode 0700, owned by us), so file permissions are the authentication.
- ``tcp://`` endpoints always use ZMQ CURVE: the server proves its identity with
  its key pair and accepts only clients whose public key is in ``authorized/``.
  An unauthenticated peer fails the handshake and never reaches the application.

Key directory layout (``rlix-async keygen DIR``)::

    DIR/server.key  DIR/server.key_secret     coordinator's key pair
    DIR/client.key  DIR/client.key_secret     a client key pair (more with --client NAME)
    DIR/authorized/client.key                 public keys the server accepts

All files are 0600 and directories 0700. Copy DIR to every node of the job (or
put it on a shared filesystem only the job's user can read).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

SERVER_CERT = "server"
DEFAULT_CLIENT = "client"
AUTHORIZED = "authorized"


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

    @classmethod
    def load(cls, keys_dir: str | Path) -> ServerKeys:
        d = Path(keys_dir)
        _check_key_dir(d)
        public, secret = _load_pair(d / f"{SERVER_CERT}.key_secret")
        authorized = d / AUTHORIZED
        if not any(authorized.glob("*.key")):
            raise SecurityError(f"{authorized} holds no public keys: nobody could connect")
        return cls(public, secret, authorized)

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

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


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


def keygen(keys_dir: str | Path, clients: list[str] | None = None) -> list[Path]:
    """Create the server key pair (if absent) and one key pair per client name."""
    d = _ensure_private_dir(Path(keys_dir))
    authorized = _ensure_private_dir(d / AUTHORIZED)
    written: list[Path] = []
    names = [SERVER_CERT] if not (d / f"{SERVER_CERT}.key_secret").exists() else []
    names += [n for n in (clients or [DEFAULT_CLIENT]) if not (d / f"{n}.key_secret").exists()]
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
    return written
