"""Which front role serves each server role: a plain table, and `make_role` that reads it."""

from __future__ import annotations

from ..core.config import Role, ServerConfig
from .pd_roles import DecodeFrontRole, PrefillFrontRole
from .roles import ColocatedRole, FrontRole

FRONT_ROLES: dict[Role, type[FrontRole]] = {
    Role.COLOCATED: ColocatedRole,
    Role.PREFILL: PrefillFrontRole,
    Role.DECODE: DecodeFrontRole,
}


def make_role(cfg: ServerConfig) -> FrontRole:
    """The front role of `cfg.role`; ValueError if the table has none."""
    role = Role(cfg.role)
    cls = FRONT_ROLES.get(role)
    if cls is None:
        raise ValueError(f"server role {role.value!r} has no front implementation")
    return cls(cfg)
