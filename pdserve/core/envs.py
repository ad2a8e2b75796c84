"""The typed environment registry: the only reader of os.environ in pdserve.

Each variable is an `EnvVar` with a type, a default and aliases (SGLang's names where one
exists). `Envs.read()` returns a frozen snapshot; components receive it instead of reading
the environment themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Generic, Mapping, TypeVar

T = TypeVar("T")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    aliases: tuple[str, ...] = ()
    doc: str = ""

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


REGISTRY: tuple[EnvVar, ...] = (
    EnvVar("PDSERVE_FORCE_QUERY_PREFILL_DP_RANK", False,
           ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK",),
           "prefill: allow mixed routing and publish force_query_dp_rank; decode: always query"),
    EnvVar("PDSERVE_BOOTSTRAP_TIMEOUT", 300.0, ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",),
           "seconds a prefill waits for the decode's destination metadata"),
    EnvVar("PDSERVE_WAITING_TIMEOUT", 300.0, ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT",),
           "seconds a decode waits for the KV after sending its metadata"),
    EnvVar("PDSERVE_TOPOLOGY_TIMEOUT", 10.0, (), "seconds to fetch a prefill's topology"),
    EnvVar("PDSERVE_DP_RANK_QUERY_TIMEOUT", 30.0, (), "seconds a decode queries /query_dp_ranks"),
    EnvVar("PDSERVE_HEARTBEAT_INTERVAL", 5.0, ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",),
           "seconds between decode heartbeats to each prefill bootstrap /health"),
    EnvVar("PDSERVE_HEARTBEAT_MAX_FAILURE", 2, ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",),
           "missed heartbeats before a prefill is declared gone"),
    EnvVar("PDSERVE_KV_QUARANTINE_TIMEOUT", 0.0, (),
           "seconds a decode keeps the KV pages of a room it failed while its prefill was unheard "
           "(a late write may still land); unset: PDSERVE_BOOTSTRAP_TIMEOUT + the transfer io timeout"),
    EnvVar("PDSERVE_ROOM_TTL", 600.0, (), "seconds a bootstrap table entry lives"),
    EnvVar("PDSERVE_BOOTSTRAP_TOKEN", "", (),
           "cluster token the bootstrap service requires on PUT /route and /register_dp_rank"),
    EnvVar("PDSERVE_CACHE_DIR", "", (), "where converted models are cached (default ~/.cache/pdserve)"),
    EnvVar("PDSERVE_MOONCAKE_PROTOCOL", "tcp", (), "mooncake transfer backend protocol: tcp or rdma"),
    EnvVar("PDSERVE_MOONCAKE_DEVICE", "", (), "mooncake RDMA device name(s), e.g. mlx5_0 (empty: Mooncake picks)"),
    EnvVar("PDSERVE_ALLOW_LONG_CONTEXT", False,
           ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"),
           "allow --context-length above the model's max_position_embeddings"),
    EnvVar("PDSERVE_ADVERTISE_HOST", "", ("SGLANG_HOST_IP",),
           "address peers are told (--advertise-host wins over it)"),
    EnvVar("PDSERVE_ADVERTISE_INTERFACE", "", ("SGLANG_LOCAL_IP_NIC",),
           "interface whose address a wildcard --host advertises (--advertise-interface wins)"),
)


@dataclass(frozen=True)
class Envs:
    """A snapshot of every registered variable, typed."""

    force_query_prefill_dp_rank: bool = False
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    topology_timeout: float = 10.0
    dp_rank_query_timeout: float = 30.0
    heartbeat_interval: float = 5.0
    heartbeat_max_failure: int = 2
    kv_quarantine_timeout: float = 0.0  # 0: derived (worker/decode.py quarantine_timeout)
    room_ttl: float = 600.0
    bootstrap_token: str = ""
    cache_dir: str = ""
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    allow_long_context: bool = False
    advertise_host: str = ""
    advertise_interface: str = ""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "Envs":
        env = os.environ if environ is None else environ
        by_field = {f.name: f for f in fields(cls)}
        values = {}
        for var in REGISTRY:
            fname = var.name.removeprefix("PDSERVE_").lower()
            assert fname in by_field, fname
            values[fname] = var.get(env)
        return cls(**values)
