"""The answer to "which prefill DP rank holds this room, and where is it": plain data.

Kept apart from rank_resolver (threads, HTTP) so that the decode machine, which only reads
answers, imports no threads or HTTP client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.failures import FailureCause

if TYPE_CHECKING:  # only named in an annotation: the table module holds locks and clocks
    from .bootstrap_table import RankInfo


@dataclass
class Resolved:
    """A room's prefill rank and that rank's registration, or why they could not be found."""

    room: int
    addr: str
    rank: int | None = None
    path: str = ""
    info: RankInfo | None = None
    instance_id: str = ""
    error: str | None = None
    seconds: float = 0.0
    cause: FailureCause = FailureCause.RESOLVE  # why it failed, when `error` is set
    topology_at: float = 0.0  # time.time() when the topology was in hand
    resolved_at: float = 0.0  # time.time() when the rank and its endpoint were known
