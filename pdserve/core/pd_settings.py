"""The PD switches and deadlines of one server, built once from its flags and the environment
(a flag wins over its PDSERVE_* variable); the prefill and decode roles, front and worker, read
them here instead of choosing between `cfg.x` and `envs.x` themselves."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ServerConfig
from .envs import Envs


@dataclass(frozen=True)
class PDSettings:
    """What a PD role needs of config and environment (core/envs.py says what each means)."""

    force_query: bool = False  # FORCE: prefill allows mixed routing; decode always queries
    bootstrap_token: str = ""  # guards PUT /route and /register_dp_rank
    bootstrap_timeout: float = 300.0  # a prefill waiting for the decode's KvReq
    waiting_timeout: float = 300.0  # a decode waiting for the KV
    topology_timeout: float = 10.0  # fetching a prefill's topology (and each bootstrap call)
    query_timeout: float = 30.0  # the /query_dp_ranks path, per room
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    room_ttl: float = 600.0  # a bootstrap table entry, a failed room's note
    kv_quarantine_timeout: float = 0.0  # 0: derived (worker/decode.py quarantine_timeout)

    @classmethod
    def of(cls, cfg: ServerConfig, envs: Envs) -> PDSettings:
        """Flags first, then the environment."""
        return cls(force_query=cfg.force_query_prefill_dp_rank or envs.force_query_prefill_dp_rank,
                   bootstrap_token=cfg.bootstrap_token or envs.bootstrap_token,
                   bootstrap_timeout=envs.bootstrap_timeout, waiting_timeout=envs.waiting_timeout,
                   topology_timeout=envs.topology_timeout, query_timeout=envs.dp_rank_query_timeout,
                   heartbeat_interval=envs.heartbeat_interval, heartbeat_max_failures=envs.heartbeat_max_failure,
                   room_ttl=envs.room_ttl, kv_quarantine_timeout=envs.kv_quarantine_timeout)
