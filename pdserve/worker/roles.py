"""Which WorkerRole each server role uses: one table, no role branches elsewhere."""

from __future__ import annotations

from ..core.config import Role
from .colocated import ColocatedRole
from .decode import DecodeRole
from .prefill import PrefillRole

ROLES = {Role.COLOCATED: ColocatedRole, Role.PREFILL: PrefillRole, Role.DECODE: DecodeRole}
