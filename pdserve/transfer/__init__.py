"""KV transfer: backends that write KV pages into a peer worker's pool and carry small control
messages (tcp built in, fake for tests, mooncake and nixl optional). No torch, no engine imports."""

from .base import (
                   PROTOCOL_VERSION,
                   TransferBackend,
                   TransferError,
                   WriteResult,
                   peer_name,
)
from .registry import backend_class, backend_names, create_backend

__all__ = [
    "PROTOCOL_VERSION", "TransferBackend", "TransferError", "WriteResult", "peer_name", "backend_class",
    "backend_names", "create_backend",
]
