"""rlix_async: an asyncio-native control plane for time-sharing GPUs between RL pipelines."""

from rlix_async.protocol import PROTOCOL_VERSION, Message, RpcError
from rlix_async.transport import (
    CallContext,
    CallTimeout,
    ConnectionLost,
    PeerInfo,
    Reply,
    RpcClient,
    RpcServer,
    TransportConfig,
)

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "CallContext",
    "CallTimeout",
    "ConnectionLost",
    "Message",
    "PeerInfo",
    "Reply",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "TransportConfig",
    "__version__",
]
