"""Async ZMQ RPC: ROUTER server, DEALER clients, typed messages, heartbeats, CURVE."""

from rlix_async.transport.client import RpcClient
from rlix_async.transport.server import RpcServer
from rlix_async.transport.types import (
    CallContext,
    CallTimeout,
    ConnectionLost,
    Deferred,
    PeerInfo,
    Reply,
    TransportConfig,
)

__all__ = [
    "CallContext",
    "CallTimeout",
    "ConnectionLost",
    "Deferred",
    "PeerInfo",
    "Reply",
    "RpcClient",
    "RpcServer",
    "TransportConfig",
]
