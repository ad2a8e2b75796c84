"""Transfer backends by name, imported lazily so an optional backend's dependency is only needed
when it is chosen. Add a backend with one line in BACKENDS ("module:Class")."""

from __future__ import annotations

import importlib

from .base import TransferBackend, TransferError

BACKENDS: dict[str, str] = {
    "tcp": "pdserve.transfer.tcp:TcpBackend",
    "fake": "pdserve.transfer.fake:FakeBackend",
    "mooncake": "pdserve.transfer.mooncake:MooncakeBackend",
    "nixl": "pdserve.transfer.nixl:NixlBackend",
}


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def backend_class(name: str) -> type[TransferBackend]:
    """The class registered under `name`; TransferError if unknown or its module fails to import."""
    target = BACKENDS.get(name)
    if target is None:
        raise TransferError(f"unknown transfer backend {name!r}; known: {', '.join(backend_names())}")
    module, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TransferError(f"transfer backend {name!r} is not available: {e}") from None


def create_backend(name: str, **options) -> TransferBackend:
    """A new, unstarted backend; `options` go to its constructor (e.g. fabric= for fake)."""
    return backend_class(name)(**options)
