"""The typed environment registry: the only reader of os.environ in pdserve.

Each variable is an `EnvVar` with a type, a default and aliases (SGLang's names where one
exists). `Envs.read()` returns a frozen snapshot; components receive it instead of reading
the environment themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Mapping, TypeVar

T = TypeVar("T")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    aliases: tuple[str, ...] = ()
    doc: str = ""
    attr: str = ""  # its Envs field

    def get(self, environ: Mapping[str, str]) -> T:
        for key in (self.name, *self.aliases):
            raw = environ.get(key)
            if raw is not None:
                return self.parse(raw, key)
        return self.default

    def parse(self, raw: str, key: str) -> T:
        kind = type(self.default)
        try:
            if kind is bool:
                low = raw.strip().lower()
                if low in _TRUE:
                    return True  # type: ignore[return-value]
                if low in _FALSE:
                    return False  # type: ignore[return-value]
                raise ValueError(raw)
            if kind is float:
                v = float(raw)
                if v <= 0:
                    raise ValueError(raw)
                return v  # type: ignore[return-value]
            if kind is int:
                return int(raw)  # type: ignore[return-value]
            return raw  # type: ignore[return-value]
        except ValueError:
            raise ValueError(f"environment variable {key}={raw!r} is not a valid {kind.__name__}") from None


def env(default: T, aliases: tuple[str, ...] = (), doc: str = "") -> T:
    """A field of `Envs`: its default, the other names it is read under, what it means."""
    return field(default=default, metadata={"aliases": aliases, "doc": doc})


@dataclass(frozen=True)
class Envs:
    """A snapshot of every registered variable, typed. Field `x` is read from PDSERVE_X, then its
    aliases (SGLang's names where one exists); each default is written here once."""

    force_query_prefill_dp_rank: bool = env(False, ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK",),
        "prefill: allow mixed routing and publish force_query_dp_rank; decode: always query")
    bootstrap_timeout: float = env(300.0, ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",),
        "seconds a prefill waits for the decode's destination metadata")
    waiting_timeout: float = env(300.0, ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT",),
        "seconds a decode waits for the KV after sending its metadata")
    topology_timeout: float = env(10.0, (),
        "seconds to fetch a prefill's topology")
    dp_rank_query_timeout: float = env(30.0, (),
        "seconds a decode queries /query_dp_ranks")
    heartbeat_interval: float = env(5.0, ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",),
        "seconds between decode heartbeats to each prefill bootstrap /health")
    heartbeat_max_failure: int = env(2, ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",),
        "missed heartbeats before a prefill is declared gone")
    kv_quarantine_timeout: float = env(0.0, (),
        "seconds a decode keeps the KV pages of a room it failed while its prefill was unheard "
        "(a late write may still land); unset: PDSERVE_BOOTSTRAP_TIMEOUT + the transfer io timeout")
    room_ttl: float = env(600.0, (),
        "seconds a bootstrap table entry lives")
    bootstrap_token: str = env("", (),
        "cluster token the bootstrap service requires on PUT /route and /register_dp_rank")
    cache_dir: str = env("", (),
        "where converted models are cached (default ~/.cache/pdserve)")
    mooncake_protocol: str = env("tcp", (),
        "mooncake transfer backend protocol: tcp or rdma")
    mooncake_device: str = env("", (),
        "mooncake RDMA device name(s), e.g. mlx5_0 (empty: Mooncake picks)")
    allow_long_context: bool = env(False,
        ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"),
        "allow --context-length above the model's max_position_embeddings")
    advertise_host: str = env("", ("SGLANG_HOST_IP",),
        "address peers are told (--advertise-host wins over it)")
    advertise_interface: str = env("", ("SGLANG_LOCAL_IP_NIC",),
        "interface whose address a wildcard --host advertises (--advertise-interface wins)")

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Envs:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {var.attr: var.get(environ) for var in REGISTRY}
        return cls(**values)


# every variable, in `Envs` order (docs and the deploy doc's test list them)
REGISTRY: tuple[EnvVar[object], ...] = tuple(
    EnvVar(f"PDSERVE_{f.name.upper()}", f.default, f.metadata["aliases"], f.metadata["doc"], f.name)
    for f in fields(Envs))
