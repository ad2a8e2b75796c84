"""Which WorkerRole a server role uses: one table, no role branches elsewhere."""

from __future__ import annotations

from ..core.config import Role, ServerConfig
from ..core.envs import Envs
from ..engine.engine import Engine
from .colocated import ColocatedRole
from .role import WorkerRole


def make_role(cfg: ServerConfig, envs: Envs, engine: Engine, model_cfg, dp_rank: int) -> WorkerRole:
    if cfg.role is Role.COLOCATED:
        return ColocatedRole(engine, dp_rank)
    raise NotImplementedError(f"role {cfg.role.value} is not available yet")
