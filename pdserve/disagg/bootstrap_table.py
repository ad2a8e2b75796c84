"""What a prefill's bootstrap service knows: its DP ranks' transfer endpoints (the topology) and
which rank holds which room. Thread-safe; the HTTP service and the prefill front share one.

Rooms expire after a TTL. "Failed wins": once a room is recorded as failed, a later record()
of a rank for it is ignored until it expires or is forgotten.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, TypeVar, cast

from ..core.config import Role
from ..core.envs import Envs
from ..core.errors import BadRequest, Unavailable
from ..core.pd_vocab import FOLLOW, BackendName, KvDtype, check_rank, check_room
from ..transfer.base import Endpoint
from .dp_rules import effective_method

T = TypeVar("T")
_NO_DEFAULT: Any = object()


def _field(d: dict[str, Any], key: str, kind: type[T], default: T = _NO_DEFAULT) -> T:
    """d[key] if it has type `kind` (bool is not an int here), else BadRequest naming the field."""
    if d.get(key) is None:
        if default is _NO_DEFAULT:
            raise BadRequest(f"missing field {key!r}")
        return default
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise BadRequest(f"field {key!r} must be {kind.__name__}, got {v!r}")
    return v


def _name(d: dict[str, Any], key: str, parse: Callable[[object], T], default: T = _NO_DEFAULT) -> T:
    """d[key] parsed by `parse` (KvDtype.parse, BackendName.parse), else BadRequest naming the field."""
    if d.get(key) is None and default is not _NO_DEFAULT:
        return default
    try:
        return parse(_field(d, key, str))
    except ValueError as e:
        raise BadRequest(f"field {key!r}: {e}") from None


@dataclass(frozen=True)
class RankInfo:
    """One prefill DP worker's registration (body of PUT /route)."""

    dp_rank: int
    dp_size: int
    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: KvDtype
    load_balance_method: str
    fingerprint: dict[str, Any] = field(default_factory=dict)  # architecture, layers, KV heads, head dim
    endpoint: Endpoint = field(default_factory=dict)  # the transfer backend's descriptor
    transfer_backend: BackendName = BackendName.TCP

    @classmethod
    def from_json(cls, d: object) -> "RankInfo":
        if not isinstance(d, dict):
            raise BadRequest("rank registration must be a JSON object")
        dp_size = _field(d, "dp_size", int)
        if dp_size < 1:
            raise BadRequest(f"dp_size must be >= 1, got {dp_size}")
        port = _field(d, "rank_port", int)
        if not 0 < port < 65536:
            raise BadRequest(f"rank_port must be in [1, 65535], got {port}")
        page_size = _field(d, "page_size", int)
        if page_size < 1:
            raise BadRequest(f"page_size must be >= 1, got {page_size}")
        method = _field(d, "load_balance_method", str)
        try:
            effective_method(method, Role.PREFILL)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return cls(
            dp_rank=check_rank(d.get("dp_rank"), dp_size, "dp_rank"),
            dp_size=dp_size,
            rank_ip=_field(d, "rank_ip", str),
            rank_port=port,
            page_size=page_size,
            kv_cache_dtype=_name(d, "kv_cache_dtype", KvDtype.parse),
            load_balance_method=method,
            fingerprint=_field(d, "fingerprint", dict, {}),
            endpoint=_field(d, "endpoint", dict, {}),
            transfer_backend=_name(d, "transfer_backend", BackendName.parse, BackendName.TCP),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def peer(self) -> Endpoint:
        """This rank's transfer endpoint descriptor (registrations without one name ip and port)."""
        return self.endpoint or {"backend": self.transfer_backend, "ip": self.rank_ip, "port": self.rank_port}


@dataclass(frozen=True)
class Topology:
    """A prefill server as a decode sees it (GET /route?prefill_dp_rank=-1)."""

    dp_size: int
    page_size: int
    kv_cache_dtype: KvDtype
    follow_bootstrap_room: bool
    force_query_dp_rank: bool
    fingerprint: dict[str, Any]
    instance_id: str
    load_balance_method: str = FOLLOW
    transfer_backend: BackendName = BackendName.TCP
    forwards_kv_requests: bool = False  # a room's home rank passes a KvReq on to its holder

    @classmethod
    def from_json(cls, d: object) -> "Topology":
        if not isinstance(d, dict):
            raise BadRequest("topology must be a JSON object")
        return cls(
            dp_size=_field(d, "dp_size", int),
            page_size=_field(d, "page_size", int),
            kv_cache_dtype=_name(d, "kv_cache_dtype", KvDtype.parse),
            follow_bootstrap_room=_field(d, "follow_bootstrap_room", bool),
            force_query_dp_rank=_field(d, "force_query_dp_rank", bool),
            fingerprint=_field(d, "fingerprint", dict, {}),
            instance_id=_field(d, "instance_id", str),
            load_balance_method=_field(d, "load_balance_method", str, FOLLOW),
            transfer_backend=_name(d, "transfer_backend", BackendName.parse, BackendName.TCP),
            forwards_kv_requests=_field(d, "forwards_kv_requests", bool, False),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Room:
    rank: int | None
    reason: str | None
    expires: float


# Registration fields every rank of one prefill server must agree on.
_SHARED = ("dp_size", "page_size", "kv_cache_dtype", "load_balance_method", "fingerprint",
           "transfer_backend")


class BootstrapTable:
    """Rooms -> prefill DP rank (or failure reason), and the prefill's registered ranks.

    `dp_size` may be given up front (the prefill front knows it) or taken from the first
    registration. The topology is ready when all dp_size ranks registered; until then
    topology() and rank() raise Unavailable (503).
    """

    def __init__(self, *, dp_size: int | None = None, force_query_dp_rank: bool = False,
                 ttl: float = Envs().room_ttl, clock: Callable[[], float] = time.monotonic,
                 instance_id: str | None = None, forwards_kv_requests: bool = False):
        if dp_size is not None and dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.dp_size = dp_size
        self.force_query_dp_rank = force_query_dp_rank
        self.forwards_kv_requests = forwards_kv_requests  # the front tells home ranks (RoomRoutedNotice)
        self.ttl = ttl
        self.instance_id = instance_id or uuid.uuid4().hex
        self._clock = clock
        self._lock = threading.Lock()
        self._rooms: OrderedDict[int, _Room] = OrderedDict()  # oldest first: expiry order
        self._ranks: dict[int, RankInfo] = {}
        self._gone: dict[int, str] = {}  # registered ranks whose worker died: rank -> why

    # ---- rooms ----
    def record(self, room: int, rank: int) -> None:
        check_room(room)
        with self._lock:
            if self.dp_size is not None:
                check_rank(rank, self.dp_size, f"dp_rank for bootstrap_room {room}")
            elif isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise BadRequest(f"dp_rank must be a non-negative integer, got {rank!r}")
            self._sweep()
            old = self._rooms.get(room)
            if old is not None and old.reason is not None:
                return  # failed wins
            self._put(room, _Room(rank, None, 0.0))

    def record_failed(self, room: int, reason: str) -> None:
        check_room(room)
        with self._lock:
            self._sweep()
            self._put(room, _Room(None, reason, 0.0))

    def lookup(self, rooms: Iterable[int]) -> tuple[dict[int, int], dict[int, str]]:
        """(found: room -> rank, failed: room -> reason); unknown or expired rooms are in neither."""
        found: dict[int, int] = {}
        failed: dict[int, str] = {}
        with self._lock:
            self._sweep()
            for room in rooms:
                entry = self._rooms.get(room)
                if entry is None:
                    continue
                if entry.reason is not None:
                    failed[room] = entry.reason
                else:
                    found[room] = entry.rank  # type: ignore[assignment]
        return found, failed

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._rooms)

    def _put(self, room: int, entry: _Room) -> None:
        entry.expires = self._clock() + self.ttl
        self._rooms.pop(room, None)
        self._rooms[room] = entry

    def _sweep(self) -> None:
        now = self._clock()
        while self._rooms:
            room, entry = next(iter(self._rooms.items()))
            if entry.expires > now:
                break
            del self._rooms[room]

    # ---- ranks ----
    def register_rank(self, info: RankInfo) -> None:
        """Add or replace (a restarted worker) one rank; BadRequest if it disagrees with the rest."""
        with self._lock:
            if self.dp_size is not None and info.dp_size != self.dp_size:
                raise BadRequest(f"rank {info.dp_rank} registered dp_size {info.dp_size}, "
                                 f"but this prefill server has dp_size {self.dp_size}")
            check_rank(info.dp_rank, info.dp_size, "dp_rank")
            peer = next((r for k, r in self._ranks.items() if k != info.dp_rank), None)
            if peer is not None:
                for name in _SHARED:
                    mine, theirs = getattr(info, name), getattr(peer, name)
                    if mine != theirs:
                        raise BadRequest(f"rank {info.dp_rank} registered {name}={mine!r}, but rank "
                                         f"{peer.dp_rank} registered {name}={theirs!r}")
            self.dp_size = info.dp_size
            self._ranks[info.dp_rank] = info
            self._gone.pop(info.dp_rank, None)

    def mark_rank_gone(self, rank: int, reason: str) -> None:
        """Rank `rank`'s worker died: rank() refuses it and /health lists it, so a decode waiting
        for its KV fails at once instead of at its deadline."""
        with self._lock:
            self._gone[rank] = reason

    def gone_ranks(self) -> dict[int, str]:
        with self._lock:
            return dict(self._gone)

    @property
    def ready(self) -> bool:
        with self._lock:
            return self.dp_size is not None and len(self._ranks) == self.dp_size

    def _require_ready(self) -> None:
        if self.dp_size is None or len(self._ranks) < self.dp_size:
            missing = sorted(set(range(self.dp_size or 0)) - set(self._ranks))
            raise Unavailable(f"bootstrap not ready: {len(self._ranks)}/{self.dp_size or '?'} prefill "
                              f"DP ranks registered (missing: {missing or 'all'})")

    def topology(self) -> Topology:
        with self._lock:
            self._require_ready()
            first = self._ranks[0]
            method = effective_method(first.load_balance_method, Role.PREFILL)
            return Topology(
                dp_size=first.dp_size, page_size=first.page_size,
                kv_cache_dtype=first.kv_cache_dtype, follow_bootstrap_room=method == FOLLOW,
                force_query_dp_rank=self.force_query_dp_rank, fingerprint=first.fingerprint,
                instance_id=self.instance_id, load_balance_method=method,
                transfer_backend=first.transfer_backend, forwards_kv_requests=self.forwards_kv_requests)

    def rank(self, k: int) -> RankInfo:
        with self._lock:
            self._require_ready()
            check_rank(k, cast(int, self.dp_size), "prefill_dp_rank")
            if k in self._gone:
                raise Unavailable(f"prefill dp_rank {k} is gone: {self._gone[k]}")
            return self._ranks[k]
