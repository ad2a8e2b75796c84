"""RankResolver against a real bootstrap service (ThreadedBootstrap on 127.0.0.1, free port) over a
BootstrapTable the test fills: each path of the decode's resolution order (docs/architecture.md), the batched
/query_dp_ranks (counted on the table side), and every way it fails."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from pdserve.core.errors import BadRequest
from pdserve.core.failures import FailureCause
from pdserve.core.launcher import free_port
from pdserve.core.pd_vocab import MAX_QUERY_ROOMS
from pdserve.disagg.bootstrap_client import BootstrapClient, BootstrapError
from pdserve.disagg.bootstrap_server import ThreadedBootstrap
from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo
from pdserve.disagg.decode_events import Resolved
from pdserve.disagg.dp_rules import conflict_message
from pdserve.disagg.prefill_peers import PrefillPeers
from pdserve.disagg.query_batcher import QueryBatcher
from pdserve.disagg.rank_resolver import RankResolver
from tests.harness.handoff_harness import WAIT_S

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]

FP = {"architecture": "LlamaForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4}


class CountingTable(BootstrapTable):
    """Records every room list /query_dp_ranks looked up; while `hidden`, it knows no room."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.queries: list[tuple[list[int], bool]] = []
        self.hidden = False

    def lookup(self, rooms):
        rooms = list(rooms)
        hidden = self.hidden
        self.queries.append((rooms, hidden))
        return ({}, {}) if hidden else super().lookup(rooms)

    def wait_query_with(self, rooms: set[int]) -> None:
        end = time.monotonic() + WAIT_S
        while not any(rooms <= set(q) for q, _ in list(self.queries)):
            assert time.monotonic() < end, f"no /query_dp_ranks call held all of {rooms}: {self.queries}"
            time.sleep(0.005)


def rank_info(rank: int, dp_size: int, method: str) -> RankInfo:
    return RankInfo(dp_rank=rank, dp_size=dp_size, rank_ip="10.0.0.1", rank_port=30000 + rank,
                    page_size=16, kv_cache_dtype="bfloat16", load_balance_method=method,
                    fingerprint=FP, endpoint={"backend": "fake", "ip": "10.0.0.1", "port": 30000 + rank},
                    transfer_backend="fake")


class Env:
    """A prefill bootstrap service plus a decode's RankResolver collecting results in a queue."""

    def __init__(self, request, *, dp_size: int = 2, method: str = "auto", force: bool = False,
                 registered: int | None = None, decode_force: bool = False,
                 topology_timeout: float = 2.0, query_timeout: float = 5.0):
        self.table = CountingTable(dp_size=dp_size, force_query_dp_rank=force)
        for rank in range(dp_size if registered is None else registered):
            self.table.register_rank(rank_info(rank, dp_size, method))
        self.server = ThreadedBootstrap(self.table)
        request.addfinalizer(self.server.stop)
        self.client = BootstrapClient(timeout=2.0)
        request.addfinalizer(self.client.close)
        self.results: queue.Queue[Resolved] = queue.Queue()
        self.resolver = RankResolver(PrefillPeers(self.client), decode_force=decode_force,
                                     topology_timeout=topology_timeout, query_timeout=query_timeout,
                                     on_result=self.results.put)
        request.addfinalizer(lambda: self.resolver.close(wait=True))
        self.addr = self.server.addr

    def resolve(self, room: int, hint: int | None = None) -> Resolved:
        self.resolver.resolve(self.addr, room, hint)
        return self.results.get(timeout=WAIT_S)

    def collect(self, n: int) -> dict[int, Resolved]:
        return {r.room: r for r in (self.results.get(timeout=WAIT_S) for _ in range(n))}


def assert_found(env: Env, res: Resolved, rank: int, path: str) -> None:
    assert res.error is None, res.error
    assert (res.rank, res.path, res.addr) == (rank, path, env.addr)
    assert res.info is not None and res.info.dp_rank == rank
    assert res.info.endpoint == {"backend": "fake", "ip": "10.0.0.1", "port": 30000 + rank}
    assert res.instance_id == env.table.instance_id
    assert res.seconds >= 0


# ---- the paths --------------------------------------------------------------------------------
def test_hint_path_wins_over_room_modulo(request):
    env = Env(request)
    assert_found(env, env.resolve(10, hint=1), 1, "hint")
    assert env.table.queries == []


def test_single_rank_path(request):
    env = Env(request, dp_size=1)
    assert_found(env, env.resolve(11), 0, "single")
    assert env.table.queries == []


def test_fast_path_is_room_modulo_dp_size(request):
    env = Env(request)
    assert_found(env, env.resolve(10), 0, "fast")
    assert_found(env, env.resolve(11), 1, "fast")
    assert env.table.queries == []


@pytest.mark.parametrize("why", ["prefill_force", "decode_force", "method_not_follow"])
def test_query_path(request, why):
    env = Env(request, force=why == "prefill_force", decode_force=why == "decode_force",
              method="round_robin" if why == "method_not_follow" else "auto")
    env.table.record(10, 1)  # not room % dp_size: only a query finds it
    assert_found(env, env.resolve(10), 1, "query")
    assert [q for q, _ in env.table.queries] == [[10]]


def test_query_waits_until_the_room_is_recorded(request):
    env = Env(request, force=True)
    env.resolver.resolve(env.addr, 21, None)
    env.table.wait_query_with({21})
    env.table.record(21, 0)
    assert_found(env, env.results.get(timeout=WAIT_S), 0, "query")


def test_rooms_pending_together_share_one_query(request):
    env = Env(request, force=True)
    rooms = {100: 1, 101: 0, 102: 1, 103: 0}
    for room, rank in rooms.items():
        env.table.record(room, rank)
    env.table.hidden = True  # recorded, but not answered yet: every room joins the batch
    for room in rooms:
        env.resolver.resolve(env.addr, room, None)
    env.table.wait_query_with(set(rooms))
    env.table.hidden = False
    got = env.collect(len(rooms))
    for room, rank in rooms.items():
        assert_found(env, got[room], rank, "query")
    answered = [q for q, hidden in env.table.queries if not hidden]
    assert len(answered) == 1 and sorted(answered[0]) == sorted(rooms)
    assert all(len(set(q)) == len(q) for q, _ in env.table.queries)  # no room twice in one call


# ---- failures ---------------------------------------------------------------------------------
def test_query_timeout_names_room_and_prefill(request):
    env = Env(request, force=True, query_timeout=0.3)
    res = env.resolve(30)
    assert res.rank is None and res.info is None and res.path == "query"
    assert "PDSERVE_DP_RANK_QUERY_TIMEOUT" in res.error
    assert "room 30" in res.error and env.addr in res.error
    assert len(env.table.queries) >= 1
    assert env.resolver.batcher.pending == {}


def test_failed_room_in_table_fails_with_its_reason(request):
    env = Env(request, force=True)
    reason = conflict_message(1, 40, 2)
    env.table.record_failed(40, reason)
    res = env.resolve(40)
    assert res.rank is None and reason in res.error
    assert "room 40" in res.error and env.addr in res.error


def test_unreachable_topology_names_the_address(request):
    port = free_port()  # nothing listens there
    env = Env(request, topology_timeout=0.3)
    addr = f"127.0.0.1:{port}"
    env.resolver.resolve(addr, 50, None)
    res = env.results.get(timeout=WAIT_S)
    assert res.rank is None and res.addr == addr
    assert addr in res.error and "room 50" in res.error and "topology" in res.error


def test_topology_not_ready_until_every_rank_registered(request):
    env = Env(request, registered=1, topology_timeout=0.3)
    res = env.resolve(60)
    assert res.rank is None and "1/2" in res.error and env.addr in res.error


def test_hint_out_of_range_is_an_error(request):
    env = Env(request)
    res = env.resolve(70, hint=5)
    assert res.rank is None and "disagg_prefill_dp_rank" in res.error and "room 70" in res.error


def test_cancelled_room_gets_no_answer_and_leaves_no_pending_query(request):
    env = Env(request, force=True)
    env.resolver.resolve(env.addr, 80, None)
    env.table.wait_query_with({80})
    env.resolver.cancel(env.addr, 80)
    assert env.resolver.batcher.pending == {}  # an empty per-address entry would poll forever
    env.table.record(80, 1)
    env.table.record(81, 0)
    assert_found(env, env.resolve(81), 0, "query")  # had 80 still been pending, it rode along
    assert env.results.empty()
    assert all(80 not in q for q, _ in env.table.queries if 81 in q)


# ---- the batcher: the per-call room limit, and addresses that do not wait on each other ------
class GatedClient(BootstrapClient):
    """A real client that notes how many rooms each /query_dp_ranks call carried; until `gate` is
    set, calls do not reach the service: they wait for the gate, then answer "nothing yet"."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sizes: list[int] = []
        self.gate = threading.Event()
        self.held: list[int] = []  # sizes of the calls held at the gate

    def query_dp_ranks(self, addr, rooms):
        self.sizes.append(len(rooms))
        if not self.gate.is_set():
            self.held.append(len(rooms))
            self.gate.wait(WAIT_S)
            return {}, {}
        return super().query_dp_ranks(addr, rooms)


class FakeQueryClient:
    """query_dp_ranks only, refusing more than MAX_QUERY_ROOMS rooms like the service: every room
    is found at rank room % 2; a call holding any room in `fail_rooms` fails; a call to an address in
    `hang` blocks until `release` is set (at most HANG_S)."""

    HANG_S = 5.0

    def __init__(self, hang: set[str] = frozenset(), fail_rooms: set[int] = frozenset()):
        self.hang, self.fail_rooms = set(hang), set(fail_rooms)
        self.release = threading.Event()
        self.hanging = threading.Event()  # set once a call to a hanging address began
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def query_dp_ranks(self, addr, rooms):
        with self._lock:
            self.calls.append((addr, len(rooms)))
        if len(rooms) > MAX_QUERY_ROOMS:
            raise BadRequest(f"at most {MAX_QUERY_ROOMS} bootstrap_rooms per query, got {len(rooms)}")
        if addr in self.hang:
            self.hanging.set()
            self.release.wait(self.HANG_S)
            raise BootstrapError(f"bootstrap {addr}: timed out")
        if self.fail_rooms & set(rooms):
            raise BootstrapError(f"bootstrap {addr}: chunk refused")
        return {r: r % 2 for r in rooms}, {}


class Answers:
    """A QueryBatcher over `client` whose on_answer calls land in a queue."""

    def __init__(self, request, client):
        self.q: queue.Queue = queue.Queue()
        self.batcher = QueryBatcher(client, lambda *a: self.q.put(a))
        request.addfinalizer(self.batcher.close)

    def collect(self, n: int, within: float = WAIT_S) -> dict[tuple[str, int], tuple]:
        got: dict[tuple[str, int], tuple] = {}
        end = time.monotonic() + within
        while len(got) < n:
            left = end - time.monotonic()
            assert left > 0, f"only {len(got)}/{n} rooms answered within {within} s"
            try:
                addr, room, rank, error, cause = self.q.get(timeout=left)
            except queue.Empty:
                continue
            assert (addr, room) not in got, f"room {room} of {addr} answered twice"
            got[(addr, room)] = (rank, error, cause)
        return got


def test_more_rooms_than_one_query_may_carry_are_all_resolved(request):
    table = CountingTable(dp_size=2, force_query_dp_rank=True)
    server = ThreadedBootstrap(table)
    request.addfinalizer(server.stop)
    client = GatedClient(timeout=2.0)
    request.addfinalizer(client.close)
    request.addfinalizer(client.gate.set)
    n = MAX_QUERY_ROOMS + 904
    for room in range(n):
        table.record(room, room % 2)
    ans = Answers(request, client)
    deadline = time.monotonic() + 3.0
    for room in range(n):
        ans.batcher.add(server.addr, room, deadline)
    # every room pending, and a round held at the gate: the rounds after it carry all n rooms
    while len(ans.batcher.pending.get(server.addr, {})) < n or not client.held:
        assert time.monotonic() < deadline, "rooms did not become pending"
        time.sleep(0.005)
    client.gate.set()
    got = ans.collect(n)
    bad = {k: v for k, v in got.items() if v[1] is not None}
    assert not bad, f"{len(bad)} rooms failed, e.g. {next(iter(bad.values()))[1]}"
    assert all(got[(server.addr, room)][0] == room % 2 for room in range(n))
    assert max(client.sizes) <= MAX_QUERY_ROOMS, max(client.sizes)
    assert sum(len(q) for q, _ in table.queries) >= n  # all of them were asked of the service
    assert ans.batcher.pending == {}


def test_a_failed_chunk_does_not_fail_the_other_rooms(request):
    # a call holding any room below MAX_QUERY_ROOMS fails. Rooms are added in order and those are
    # never answered before their deadline, so they fill the first chunk of every round (all of it
    # once every room is pending) and time out; the 10 rooms after them, in a chunk of their own,
    # do not wait for that
    client = FakeQueryClient(fail_rooms=set(range(MAX_QUERY_ROOMS)))
    ans = Answers(request, client)
    n = MAX_QUERY_ROOMS + 10
    deadline = time.monotonic() + 1.5
    for room in range(n):
        ans.batcher.add("p:1", room, deadline)
    first = ans.collect(10, within=1.0)  # before the failing chunk's rooms time out
    assert first == {("p:1", room): (room % 2, None, FailureCause.RESOLVE) for room in range(MAX_QUERY_ROOMS, n)}
    rest = ans.collect(MAX_QUERY_ROOMS)
    assert {room for _, room in rest} == set(range(MAX_QUERY_ROOMS))
    for rank, error, cause in rest.values():
        assert rank is None and cause == FailureCause.TIMEOUT and "chunk refused" in error, error
    assert max(size for _, size in client.calls) <= MAX_QUERY_ROOMS
    assert ans.batcher.pending == {}


def test_a_hanging_prefill_does_not_delay_the_others(request):
    client = FakeQueryClient(hang={"slow:1"})
    request.addfinalizer(client.release.set)
    ans = Answers(request, client)
    far = time.monotonic() + 30.0
    ans.batcher.add("slow:1", 1, far)
    assert client.hanging.wait(WAIT_S)  # its round is in flight, blocked
    t0 = time.monotonic()
    for room in (2, 3, 4):
        ans.batcher.add("fast:1", room, far)
    got = ans.collect(3, within=1.0)
    took = time.monotonic() - t0
    assert took < 1.0, took
    assert {k: v[0] for k, v in got.items()} == {("fast:1", 2): 0, ("fast:1", 3): 1, ("fast:1", 4): 0}
    # the hung address keeps its room pending (not waited for) and others keep being served
    ans.batcher.add("fast:1", 5, far)
    assert ans.collect(1, within=1.0) == {("fast:1", 5): (1, None, FailureCause.RESOLVE)}
    assert ans.batcher.pending == {"slow:1": {1: far}}
    ans.batcher.cancel("slow:1", 1)
    client.release.set()
    ans.batcher.close()
    assert ans.q.empty()  # the cancelled room got no answer
