"""Transfer backends by name, imported lazily so an optional backend's dependency is only needed
when it is chosen. Add a backend with one line in BACKENDS ("module:Class")."""

from __future__ import annotations

import importlib
from typing import Any

from ..core.pd_vocab import BackendName
from .base import TransferBackend, TransferError

BACKENDS: dict[BackendName, str] = {
    BackendName.TCP: "pdserve.transfer.tcp:TcpBackend",
    BackendName.FAKE: "pdserve.transfer.fake:FakeBackend",
    BackendName.MOONCAKE: "pdserve.transfer.mooncake:MooncakeBackend",
    BackendName.NIXL: "pdserve.transfer.nixl:NixlBackend",
}


def backend_names() -> list[str]:
    return sorted(b.value for b in BACKENDS)


def backend_class(name: str) -> type[TransferBackend]:
    """The class registered under `name` (BackendName.parse); TransferError if unknown or its
    module fails to import."""
    try:
        target = BACKENDS[BackendName.parse(name)]
    except ValueError as e:
        raise TransferError(str(e)) from None
    module, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TransferError(f"transfer backend {name!r} is not available: {e}") from None


def create_backend(name: str, **options: Any) -> TransferBackend:
    """A new, unstarted backend; `options` go to its constructor (e.g. fabric= for fake)."""
    return backend_class(name)(**options)
