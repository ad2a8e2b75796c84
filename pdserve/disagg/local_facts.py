"""What one PD worker is, as its peers must see it: transfer backend, KV layout and dtype, model
fingerprint, endpoint. Built once when the worker's backend starts (worker/role.py); the
KvReq carries it to the prefill (decode_events.kv_req), which checks it against its own
(`compat_problem`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.kv_layout import KVLayout
from ..core.pd_vocab import BackendName, KvDtype
from ..transfer.base import Endpoint
from .wire import KvReq

COMPAT_KEYS = ("backend", "page_size", "kv_dtype", "fingerprint")  # what a KvReq must agree on


@dataclass(frozen=True)
class LocalFacts:
    """This worker's transfer facts. `page_size` and `kv_dtype` are the layout's (`of`)."""

    backend: BackendName
    page_size: int
    kv_dtype: KvDtype
    fingerprint: dict[str, Any]  # the model's (hf_config.ModelConfig.fingerprint)
    layout: KVLayout
    endpoint: Endpoint

    @classmethod
    def of(cls, backend: str, layout: KVLayout, fingerprint: dict[str, Any], endpoint: Endpoint) -> LocalFacts:
        """`backend` is a name (BackendName.parse: ValueError if unknown)."""
        return cls(BackendName.parse(backend), layout.page_size, KvDtype.parse(layout.dtype), fingerprint, layout,
                   endpoint)


def compat_problem(local: LocalFacts, req: KvReq) -> str | None:
    """Why a decode's KvReq cannot be served by this prefill worker (`local`), or None."""
    for key in COMPAT_KEYS:
        ours, other = getattr(local, key), getattr(req, key)
        if ours != other:
            return f"{key} mismatch: prefill has {ours!r}, decode has {other!r}"
    return None
