"""PrefillRole and DecodeRole driven by hand over torch-free FakeEngines (tests/harness/fake_engine.py):
the WorkerRole contract -- every accepted GenerateReq yields exactly one finished TokenOutput,
and every KV page a role takes is back in its engine by then -- under each fault.

No model, no processes: both roles run on this thread (the test is their worker loop: requests
in, `poll()`, engine steps fed to `on_step`), their transfer backends are FakeBackends on one
FakeFabric (pages really move between the two numpy pools), and the prefill registers with a
real ThreadedBootstrap on 127.0.0.1 that the decode resolves it through. Every wait has a
deadline; every thread, backend and server is closed by the fixture's finalizer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np
import pytest

from pdserve.core.config import Role, ServerConfig
from pdserve.core.envs import Envs
from pdserve.core.messages import GenerateReq, PDParams, TokenOutput
from pdserve.core.sampling import SamplingParams
from pdserve.disagg import kv_receiver
from pdserve.disagg.bootstrap_server import ThreadedBootstrap
from pdserve.disagg.bootstrap_table import BootstrapTable
from pdserve.disagg.decode_events import PeerGone
from pdserve.engine import sequence as engine_sequence
from pdserve.engine.allocator import PageAllocator
from pdserve.transfer.fake import FakeFabric
from pdserve.worker import role as worker_role
from pdserve.worker.decode import DecodeRole
from pdserve.worker.prefill import PrefillRole
from pdserve.worker.role import RoleContext, WorkerRole
from tests.harness.fake_engine import FakeEngine, StepOutput, fake_continuation, fake_logprob
from tests.harness.handoff_harness import GatedBackend

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]

PAGE_SIZE = 4
VOCAB = 1000
PROMPT = list(range(101, 111))  # 10 tokens: 3 pages
ROOM = 4242
WAIT_S = 5.0
ENVS = Envs(bootstrap_timeout=5.0, waiting_timeout=5.0, topology_timeout=2.0, dp_rank_query_timeout=2.0,
            heartbeat_interval=1.0, heartbeat_max_failure=2, room_ttl=60.0)
CONFLICT = "follow_bootstrap_room conflict: dispatched to dp_rank 1 but the room implies 0 (test)"


class Worker:
    """One role over one FakeEngine, and what it answered per request id."""

    def __init__(self, name: str, role: WorkerRole, engine: FakeEngine):
        self.name, self.role, self.engine = name, role, engine
        self.sent: list[str] = []
        self.outputs: dict[str, list[TokenOutput]] = {}
        self.stepping = True  # False: the loop polls but does not step the engine
        self.turning = True  # False: the loop does not turn at all (messages wait in the pump)

    def take(self, outs: list[TokenOutput]) -> None:
        for o in outs:
            assert o.rid in self.sent, f"{self.name}: output for a request it never got: {o}"
            seen = self.outputs.setdefault(o.rid, [])
            assert not any(p.finished for p in seen), f"{self.name}: output after the finished one: {o}"
            seen.append(o)

    def generate(self, req: GenerateReq) -> list[TokenOutput]:
        self.sent.append(req.rid)
        outs = self.role.on_generate(req)
        self.take(outs)
        return outs

    def abort(self, rid: str, reason: str = "client disconnected") -> list[TokenOutput]:
        outs = self.role.on_abort(rid, reason)
        self.take(outs)
        return outs

    def turn(self) -> None:
        if not self.turning:
            return
        self.take(self.role.poll())
        if self.stepping and self.engine.has_work():
            self.take(self.role.on_step(self.engine.step()))

    def busy(self) -> bool:
        return self.stepping and self.engine.has_work()

    def final(self, rid: str) -> TokenOutput | None:
        outs = self.outputs.get(rid, [])
        return outs[-1] if outs and outs[-1].finished else None

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.token_ids]

    def all_finished(self) -> bool:
        return all(self.final(rid) is not None for rid in self.sent)

    def check(self) -> None:
        """The contract: one finished output per request, every page back in the engine."""
        for rid in self.sent:
            finished = [o for o in self.outputs.get(rid, []) if o.finished]
            assert len(finished) == 1, f"{self.name}: {rid} got {len(finished)} finished outputs"
        assert self.engine.leaks() == [], f"{self.name}: {self.engine.leaks()}"
        assert self.role.inflight_transfers() == 0, f"{self.name}: {self.role.stats_extra()}"


class PD:
    """A prefill worker and a decode worker (dp_rank 0 each), the prefill's bootstrap service and
    the FakeFabric between them. `start()` builds; `close()` (the finalizer) undoes any part."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.fabric = FakeFabric()
        self.woken = threading.Event()
        self._closers: list[Callable[[], None]] = []
        fabric = self.fabric

        class Backend(GatedBackend):  # what start_backend builds: a fake endpoint on our fabric
            def __init__(self):
                super().__init__(fabric)

        def backend_class(name: str):
            assert name == "fake", name
            return Backend

        monkeypatch.setattr(worker_role, "backend_class", backend_class)

    def start(self, *, envs: Envs = ENVS, prefill_pages: int = 16, decode_pages: int = 16) -> "PD":
        self.boot = ThreadedBootstrap(BootstrapTable(dp_size=1))
        self._closers.append(self.boot.stop)
        self.prefill = self._worker("prefill", PrefillRole, Role.PREFILL, prefill_pages, envs)
        self.decode = self._worker("decode", DecodeRole, Role.DECODE, decode_pages, envs)
        return self

    def _worker(self, name, cls, role: Role, pages: int, envs: Envs) -> Worker:
        engine = FakeEngine(pages, PAGE_SIZE, vocab_size=VOCAB)
        cfg = ServerConfig(role=role, transfer_backend="fake", bootstrap_port=self.boot.port, cpu_bind="none")
        r = cls(RoleContext(engine, 0, cfg, envs, engine.model_cfg, self.woken.set))
        self._closers.append(lambda: _close_role(r))
        r.start()
        return Worker(name, r, engine)

    @property
    def workers(self) -> list[Worker]:
        return [w for w in (getattr(self, "prefill", None), getattr(self, "decode", None)) if w]

    def close(self) -> None:
        for w in self.workers:  # role.close() below closes the rest (closing twice is a no-op)
            w.role.backend.gate.set()
            w.role.pump.stop_event.set()
            w.role.backend.close()  # wakes its pump now, not at the end of its recv(0.2)
        errors = []
        for close in reversed(self._closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - close the rest, then report
                errors.append(e)
        if errors:
            raise errors[0]

    # ---- requests ----
    def req(self, rid: str, *, room: int = ROOM, prompt: list[int] = PROMPT, max_new: int = 4,
            return_logprob: bool = False) -> GenerateReq:
        return GenerateReq(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0),
                           return_logprob, PDParams("127.0.0.1", self.boot.port, room))

    # ---- the loop ----
    def drive(self, until: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
        """Turn both workers' loops until `until()`, failing after `timeout` seconds."""
        end = time.monotonic() + timeout
        while True:
            self.woken.clear()
            for w in self.workers:
                w.turn()
            if until():
                return
            if time.monotonic() > end:
                raise AssertionError(f"not within {timeout}s: {what}; outputs: "
                                     f"{ {w.name: w.outputs for w in self.workers} }")
            if not any(w.busy() for w in self.workers):
                self.woken.wait(0.005)

    def finish(self, timeout: float = WAIT_S) -> None:
        """Drive until every request has its finished output, a little longer (a late or second
        output would show), then check the contract on both workers."""
        self.drive(lambda: all(w.all_finished() for w in self.workers), "every request finished", timeout)
        end = time.monotonic() + 0.02
        self.drive(lambda: time.monotonic() > end, "settling")
        for w in self.workers:
            w.check()

    def handoff_states(self, w: Worker) -> dict[str, int]:
        return w.role.stats_extra()["handoff_states"]


def _close_role(role: WorkerRole) -> None:
    """role.close() for a started role; for one whose start() failed, whatever it had started."""
    if hasattr(role, "pump") and hasattr(role, "backend") and (
            hasattr(role, "sender") or hasattr(role, "receiver")):
        role.close()
        return
    for part in ("link", "pump", "sender", "receiver", "backend"):
        if hasattr(role, part):
            getattr(role, part).close()


@pytest.fixture
def make_pd(monkeypatch, request) -> Callable[..., PD]:
    def make(**kw) -> PD:
        pd = PD(monkeypatch)
        request.addfinalizer(pd.close)
        return pd.start(**kw)
    return make


@pytest.fixture
def pd(make_pd) -> PD:
    return make_pd()


FIRST = fake_continuation(PROMPT, 1, VOCAB)[0]


def assert_success(pd: PD, prid: str = "p-1", drid: str = "d-1", max_new: int = 4) -> None:
    p, d = pd.prefill.final(prid), pd.decode.final(drid)
    assert p.error is None and p.token_ids == [FIRST] and p.finish_reason["type"] == "length", p
    assert d.error is None, d
    assert pd.decode.tokens(drid) == fake_continuation(PROMPT, max_new, VOCAB)
    assert pd.decode.engine.imports[drid], "the decode's pages did not hold the prompt's KV"


def assert_kv_moved(pd: PD, prid: str = "p-1", drid: str = "d-1") -> None:
    src = pd.prefill.engine.held_log[prid]
    [dst] = [pages for rid, _, pages in pd.decode.engine.reserve_calls if rid == drid and pages]
    n = len(PROMPT)
    assert np.array_equal(pd.decode.engine.pool.read(dst, n), pd.prefill.engine.pool.read(src, n))


def assert_failed(out: TokenOutput | None, *needles: str) -> None:
    assert out is not None and out.finished and out.error is not None, out
    assert out.finish_reason["type"] == "abort" and out.token_ids == [], out
    for needle in needles:
        assert needle in out.error.message, (needle, out.error.message)


# ---- the fake engine itself -------------------------------------------------------------------
def test_fake_engine_uses_the_engines_own_step_output_and_allocator():
    real = [(f.name, f.default) for f in dataclasses.fields(engine_sequence.StepOutput)]
    assert [(f.name, f.default) for f in dataclasses.fields(StepOutput)] == real
    assert StepOutput is engine_sequence.StepOutput and type(FakeEngine().allocator) is PageAllocator


# ---- success ----------------------------------------------------------------------------------
@pytest.mark.parametrize("decode_first", [False, True], ids=["prefill_first", "decode_first"])
def test_success_first_token_and_kv_bytes_reach_the_decode(pd, decode_first):
    reqs = [(pd.prefill, pd.req("p-1", return_logprob=True)), (pd.decode, pd.req("d-1", return_logprob=True))]
    for w, r in reversed(reqs) if decode_first else reqs:
        assert w.generate(r) == []
    pd.finish()
    assert_success(pd)
    assert_kv_moved(pd)
    p, d = pd.prefill.final("p-1"), pd.decode.final("d-1")
    assert p.token_logprobs == [fake_logprob(FIRST)]
    assert pd.decode.outputs["d-1"][0].token_logprobs == [fake_logprob(FIRST)]
    assert p.meta["bootstrap_room"] == ROOM and pd.decode.outputs["d-1"][0].meta["bootstrap_room"] == ROOM
    assert d.finish_reason == {"type": "length", "length": 4} and d.prompt_tokens == len(PROMPT)
    # aborts after the end change nothing
    assert pd.prefill.abort("p-1") == [] and pd.decode.abort("d-1") == []
    pd.finish()


def test_kv_req_for_an_unknown_room_waits_for_the_request(pd):
    pd.decode.generate(pd.req("d-1"))
    pd.drive(lambda: pd.prefill.role.stats_extra()["early_kv_reqs"] == 1, "the kv_req queued early")
    assert pd.decode.final("d-1") is None
    pd.prefill.generate(pd.req("p-1"))
    pd.finish()
    assert_success(pd)
    assert_kv_moved(pd)


# ---- decode aborted -----------------------------------------------------------------------------
def test_decode_aborted_before_kv_req(make_pd):
    """The decode never resolved the rank, so it can only post /fail_room to the bootstrap
    service; with no prefill front behind this test's service nothing passes it on, and the
    prefill holds its pages until its bootstrap deadline (short here), then frees them."""
    pd = make_pd(envs=dataclasses.replace(ENVS, bootstrap_timeout=0.5))
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.decode.abort("d-1")  # before any poll: no pages reserved, no kv_req sent
    pd.drive(lambda: pd.decode.final("d-1") is not None, "the decode's abort output")
    assert_failed(pd.decode.final("d-1"), "aborted")
    assert pd.decode.engine.reserve_calls == []
    pd.finish()
    assert_failed(pd.prefill.final("p-1"), f"room {ROOM}", "PDSERVE_BOOTSTRAP_TIMEOUT")


def test_decode_aborted_after_kv_req(pd):
    pd.prefill.stepping = False  # the prefill has the kv_req but has not prefilled yet
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(lambda: pd.handoff_states(pd.prefill) == {"waiting_for_input": 1}, "the kv_req at the prefill")
    pd.decode.abort("d-1")
    # the kv_abort ends the room before the prefill ran (stepping now could race it: the write
    # would start, its kv_done go out, and the prefill leg rightly succeed)
    pd.drive(lambda: pd.prefill.final("p-1") is not None, "the prefill failed by the kv_abort")
    pd.prefill.stepping = True
    pd.finish()
    assert_failed(pd.decode.final("d-1"), "aborted")
    assert_failed(pd.prefill.final("p-1"), f"room {ROOM}", "aborted")


def test_decode_aborted_after_kv_req_before_the_prefill_request(pd):
    pd.decode.generate(pd.req("d-1"))
    pd.drive(lambda: pd.prefill.role.stats_extra()["early_kv_reqs"] == 1, "the kv_req queued early")
    pd.decode.abort("d-1")
    pd.drive(lambda: pd.decode.final("d-1") is not None, "the decode's abort output")
    pd.prefill.generate(pd.req("p-1"))  # the room is doomed there: it fails at once
    pd.finish(timeout=1.0)
    assert_failed(pd.decode.final("d-1"), "aborted")
    assert_failed(pd.prefill.final("p-1"), f"room {ROOM}", "aborted")


def test_decode_aborted_during_the_write_keeps_its_pages_until_it_ends(pd):
    backend = pd.prefill.role.backend
    backend.gate.clear()
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(backend.writing.is_set, "the KV write started")
    pd.decode.abort("d-1")
    end = time.monotonic() + 0.1
    pd.drive(lambda: time.monotonic() > end, "a while with the write stuck")
    assert pd.decode.final("d-1") is None and "d-1" in pd.decode.engine.held  # a write may still land
    assert pd.prefill.final("p-1") is None and "p-1" in pd.prefill.engine.held  # the write reads them
    backend.gate.set()
    pd.finish()
    assert_failed(pd.decode.final("d-1"), "aborted")
    assert_failed(pd.prefill.final("p-1"), "aborted")


def test_decode_aborted_while_decoding(pd):
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1", max_new=40))
    pd.drive(lambda: len(pd.decode.outputs.get("d-1", [])) >= 3, "three decode outputs")
    [out] = pd.decode.abort("d-1", "client went away")
    assert out.finished and out.error.status == 499 and "client went away" in out.error.message
    pd.finish()
    assert pd.prefill.final("p-1").error is None


# ---- prefill aborted --------------------------------------------------------------------------
def test_prefill_aborted_before_its_prefill(pd):
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    [out] = pd.prefill.abort("p-1", "router cancelled")
    assert_failed(out, f"room {ROOM}", "router cancelled")
    pd.finish()
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "router cancelled")


def test_prefill_aborted_while_holding_kv_before_kv_req(pd):
    pd.prefill.generate(pd.req("p-1"))
    pd.drive(lambda: "p-1" in pd.prefill.engine.held, "the prefill holding its KV")
    [out] = pd.prefill.abort("p-1", "router cancelled")
    assert_failed(out, "router cancelled")
    assert pd.prefill.engine.leaks() == []
    pd.decode.generate(pd.req("d-1"))  # its kv_req meets a doomed room
    pd.finish()
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "router cancelled")


def test_prefill_aborted_after_kv_req(pd):
    pd.prefill.stepping = False
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(lambda: pd.handoff_states(pd.prefill) == {"waiting_for_input": 1}, "the kv_req at the prefill")
    [out] = pd.prefill.abort("p-1", "router cancelled")
    assert_failed(out, "router cancelled")
    pd.prefill.stepping = True
    pd.finish()
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "router cancelled")


def test_prefill_aborted_during_the_write(pd):
    """The write that was running completes and its kv_done goes out: the decode succeeds."""
    backend = pd.prefill.role.backend
    backend.gate.clear()
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(backend.writing.is_set, "the KV write started")
    assert pd.prefill.abort("p-1", "router cancelled") == []  # the write still reads the pages
    assert "p-1" in pd.prefill.engine.held
    backend.gate.set()
    pd.finish()
    assert_failed(pd.prefill.final("p-1"), "router cancelled")
    assert pd.decode.final("d-1").error is None
    assert pd.decode.tokens("d-1") == fake_continuation(PROMPT, 4, VOCAB)
    assert_kv_moved(pd)


@pytest.mark.parametrize("how", ["abort", "room_failed"])
def test_prefill_failed_with_the_kv_req_waiting_in_its_inbox(pd, how):
    """A kv_req for a room that failed but is not reaped yet is answered (it used to be dropped
    as a duplicate, and the decode held its pages until PDSERVE_WAITING_TIMEOUT)."""
    pd.prefill.turning = False  # the decode's kv_req reaches the prefill's pump, not yet its loop
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(lambda: pd.prefill.role.pump.inbox.qsize() == 1, "the kv_req in the prefill's inbox")
    if how == "abort":
        pd.prefill.abort("p-1", "router cancelled")  # fails the room, then polls: drains the kv_req
    else:
        pd.prefill.role.on_room_failed(ROOM, CONFLICT)  # the next poll drains the kv_req
    pd.prefill.turning = True
    pd.finish(timeout=1.0)  # the decode's waiting timeout is 5 s: it must be told, not time out
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}")


# ---- the front failed the room --------------------------------------------------------------------
@pytest.mark.parametrize("when", ["before_request", "after_request", "no_request"])
def test_room_failed_by_the_front(pd, when):
    if when == "before_request":
        pd.prefill.role.on_room_failed(ROOM, CONFLICT)
    if when != "no_request":
        pd.prefill.generate(pd.req("p-1"))
    if when == "after_request":
        pd.drive(lambda: "p-1" in pd.prefill.engine.held, "the prefill holding its KV")
        pd.prefill.role.on_room_failed(ROOM, CONFLICT)
    if when == "no_request":
        pd.prefill.role.on_room_failed(ROOM, CONFLICT)
    pd.decode.generate(pd.req("d-1"))
    pd.finish()
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", CONFLICT)
    assert pd.decode.final("d-1").meta.get("failure_cause") == "conflict"
    if when != "no_request":
        assert_failed(pd.prefill.final("p-1"), CONFLICT)


def test_prefill_refusing_a_bad_pd_request_fails_its_decode_at_once(pd):
    [out] = pd.prefill.generate(pd.req("p-1", prompt=[]))
    assert out.finished and out.error.status == 400 and "empty prompt" in out.error.message
    pd.decode.generate(pd.req("d-1"))
    pd.finish(timeout=2.0)
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "empty prompt")


# ---- transfer failure ---------------------------------------------------------------------------
def test_write_failure_fails_both_legs_and_the_next_room_succeeds(pd):
    pd.prefill.role.backend.faults.fail_writes = 1
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.finish()
    assert_failed(pd.prefill.final("p-1"), f"room {ROOM}", "injected write failure")
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "injected write failure")
    assert pd.decode.final("d-1").meta.get("failure_cause") == "transfer"
    pd.prefill.generate(pd.req("p-2", room=ROOM + 1))
    pd.decode.generate(pd.req("d-2", room=ROOM + 1))
    pd.finish()
    assert_success(pd, "p-2", "d-2")
    assert_kv_moved(pd, "p-2", "d-2")


# ---- decode pool full ---------------------------------------------------------------------------
def test_decode_pool_full_waits_then_succeeds_when_pages_free(make_pd):
    pd = make_pd(decode_pages=8)
    assert pd.decode.engine.reserve("blocker", 8 * PAGE_SIZE) is not None  # every page taken
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    turns = iter(range(10))  # it stays in the decode's admission queue, turn after turn
    pd.drive(lambda: pd.decode.role.stats_extra()["queued_handoffs"] == 1 and next(turns) == 9,
             "ten turns with the handoff queued")
    assert not [c for c in pd.decode.engine.reserve_calls if c[0] == "d-1" and c[2] is not None]
    assert pd.prefill.role.stats_extra()["early_kv_reqs"] == 0 and pd.handoff_states(pd.prefill) == {
        "bootstrapping": 1}  # no kv_req without pages
    assert pd.decode.final("d-1") is None
    pd.decode.engine.release("blocker")
    pd.finish()
    assert_success(pd)
    assert_kv_moved(pd)


class StillClock:
    """`time` as kv_receiver reads it, with a monotonic clock that stands still until the test
    moves it (`advance`): the decode's handoff deadlines then count the test's seconds, not
    however long a busy machine takes to get there. Wall-clock stamps (time.time) stay real."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_decode_pool_full_until_the_waiting_timeout(make_pd, monkeypatch):
    """The decode gives up for want of pages once PDSERVE_WAITING_TIMEOUT has passed; it tells
    the prefill (KvAbort), which frees its pages at once instead of at its bootstrap deadline
    (far away here). The deadline counts from the accept and covers the rank resolution too
    (PDSERVE_WAITING_TIMEOUT: a decode room in any handoff state), so the decode's clock stands
    still until the room waits for pages: on real time, a busy machine's resolution could use
    the 0.3 s up first and fail the room before it has a rank, with no KvAbort (its /fail_room
    only reaches this harness's bootstrap table; a server's front would tell the prefill)."""
    clock = StillClock()
    monkeypatch.setattr(kv_receiver, "time", clock)
    pd = make_pd(decode_pages=8, envs=dataclasses.replace(ENVS, waiting_timeout=0.3, bootstrap_timeout=60.0))
    pd.decode.engine.reserve("blocker", 8 * PAGE_SIZE)
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(lambda: pd.decode.role.stats_extra()["queued_handoffs"] == 1 and "p-1" in pd.prefill.engine.held,
             "the handoff queued for pages and the prefill holding its KV")
    clock.advance(0.29)
    turns = iter(range(10))
    pd.drive(lambda: next(turns) == 9, "ten turns 0.29 s after the accept")
    assert pd.decode.final("d-1") is None and pd.prefill.final("p-1") is None
    assert pd.decode.role.stats_extra()["queued_handoffs"] == 1
    clock.advance(0.02)
    pd.drive(lambda: pd.prefill.all_finished() and pd.decode.all_finished(), "both legs failed")
    assert "p-1" not in pd.prefill.engine.held
    pd.decode.engine.release("blocker")
    pd.finish()
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "PDSERVE_WAITING_TIMEOUT")
    assert_failed(pd.prefill.final("p-1"), f"room {ROOM}", "decode dp_rank 0 aborted it", "PDSERVE_WAITING_TIMEOUT")


# ---- duplicate rooms ---------------------------------------------------------------------------
def test_duplicate_room_on_the_prefill_is_refused_and_the_first_succeeds(pd):
    pd.prefill.generate(pd.req("p-1"))
    outs = pd.prefill.generate(pd.req("p-2"))  # same bootstrap_room
    assert len(outs) == 1 and outs[0].finished and outs[0].error is not None, outs
    assert 400 <= outs[0].error.status < 500 and str(ROOM) in outs[0].error.message
    pd.decode.generate(pd.req("d-1"))
    pd.finish()
    assert_success(pd)
    assert_kv_moved(pd)


def test_duplicate_room_on_the_decode_is_refused_and_the_first_succeeds(pd):
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    [out] = pd.decode.generate(pd.req("d-2"))  # same bootstrap_room
    assert out.finished and 400 <= out.error.status < 500 and str(ROOM) in out.error.message
    pd.finish()
    assert_success(pd)
    assert_kv_moved(pd)


# ---- requests that are not handoffs ------------------------------------------------------------
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_request_without_pd_fields_is_refused_and_health_checks_run_locally(pd, side):
    w = getattr(pd, side)
    plain = dataclasses.replace(pd.req("x-1"), pd=None)
    [out] = w.generate(plain)
    assert out.finished and out.error.status == 400 and "bootstrap_room" in out.error.message
    health = dataclasses.replace(pd.req("h-1", max_new=3), pd=None, health_check=True)
    assert w.generate(health) == []
    pd.finish()
    assert w.final("h-1").error is None and w.tokens("h-1") == fake_continuation(PROMPT, 3, VOCAB)


def test_decode_refuses_a_request_its_pool_cannot_hold(pd):
    [out] = pd.decode.generate(pd.req("d-1", prompt=list(range(1, 70))))  # 69 + 4 tokens > 64 slots
    assert out.finished and out.error.status == 400 and "more than the pool holds" in out.error.message
    pd.finish()


# ---- conditional disaggregation -------------------------------------------------------------------
@pytest.mark.parametrize("when", ["before_request", "after_request"])
def test_decode_prefills_itself_when_the_prefill_is_overloaded(pd, when):
    """--disagg-prefill-overload-tokens: the prefill's last reported load is above the bound, so
    the decode runs the prompt itself; the prefill, told to drop the room (before or after its
    request arrived), ends it with a success and no transfer."""
    decode = pd.decode.role
    decode.overload = 100
    decode.link.load_tokens = lambda addr: 5000  # what the prefill's last /health said
    if when == "after_request":
        pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    assert decode.receiver.inflight() == 0  # no handoff on the decode
    pd.prefill.role.on_room_dropped(ROOM, "decode dp_rank 0 prefilled it")  # the front's notice
    if when == "before_request":
        pd.prefill.generate(pd.req("p-1"))
    pd.finish()
    d, p = pd.decode.final("d-1"), pd.prefill.final("p-1")
    assert d.error is None and pd.decode.tokens("d-1") == fake_continuation(PROMPT, 4, VOCAB)
    first_meta = pd.decode.outputs["d-1"][0].meta
    assert (first_meta["disaggregation"] == "local"
            and "5000 prompt tokens in flight" in first_meta["local_prefill_reason"])
    assert p.error is None and p.token_ids == [] and p.meta["disaggregation"] == "dropped"
    assert pd.decode.engine.reserve_calls == []  # nothing reserved for a transfer


def test_a_decode_below_the_overload_bound_uses_the_prefill(pd):
    decode = pd.decode.role
    decode.overload = 100
    decode.link.load_tokens = lambda addr: 50
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.finish()
    assert_success(pd)


@pytest.mark.parametrize("overloaded", [False, True])
def test_the_drop_notice_goes_before_the_first_token(pd, overloaded):
    """A decode that prefills a prompt itself (short uncached part, or an overloaded prefill)
    tells the prefill to drop the room before its own first token, so the prefill stops
    computing it."""
    decode = pd.decode.role
    if overloaded:
        decode.overload = 100
        decode.link.load_tokens = lambda addr: 5000
    else:
        decode.local_max = 64
    sent: list[int] = []  # tokens the decode had sampled when each notice was handed to the link
    engine = pd.decode.engine

    def drop_room(addr: str, room: int, reason: str) -> None:
        """The notice goes where the prefill front would pass it (RoomDroppedNotice)."""
        sent.append(next((len(s.output_ids) for s in engine.running if s.req.rid == "d-1"), 0))
        pd.prefill.role.on_room_dropped(room, reason)

    decode.link.drop_room = drop_room
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    assert sent == [0]
    pd.finish()
    assert sent == [0], sent
    p = pd.prefill.final("p-1")
    assert p.error is None and p.meta["disaggregation"] == "dropped"
    assert pd.decode.tokens("d-1") == fake_continuation(PROMPT, 4, VOCAB)


# ---- a prefill the decode cannot hear (partitioned, not dead) -----------------------------------
def test_an_unheard_prefill_mid_write_fails_the_client_at_once_and_frees_the_pages_after_its_kv_done(pd):
    """Heartbeat loss while the KV write runs: the decode's client gets its error at once, but the
    room's pages stay reserved (no other request gets them, the decode is not idle) until the
    prefill's late kv_done says the write is over."""
    backend, decode = pd.prefill.role.backend, pd.decode.role
    backend.gate.clear()
    pd.prefill.generate(pd.req("p-1"))
    pd.decode.generate(pd.req("d-1"))
    pd.drive(backend.writing.is_set, "the KV write started")
    addr = f"127.0.0.1:{pd.boot.port}"
    decode.receiver.inbox.post(PeerGone(addr, f"prefill bootstrap {addr} missed 2 heartbeats (1.0s apart): "
                                              "prefill server is gone"))  # as the heartbeat reports it
    pd.drive(lambda: pd.decode.final("d-1") is not None, "the decode's answer")
    assert_failed(pd.decode.final("d-1"), f"room {ROOM}", "missed 2 heartbeats")
    assert "d-1" in pd.decode.engine.held  # the write may still land in them
    extra = decode.stats_extra()
    assert extra["quarantined_handoffs"] == 1 and extra["handoff_states"] == {"quarantined": 1}
    assert decode.inflight_transfers() == 1
    [out] = pd.decode.generate(pd.req("d-3"))  # the quarantined room's number
    assert out.error.status == 400 and "quarantined" in out.error.message
    pd.prefill.generate(pd.req("p-2", room=ROOM + 1))
    pd.decode.generate(pd.req("d-2", room=ROOM + 1))
    pages = lambda rid: [p for r, _, p in pd.decode.engine.reserve_calls if r == rid and p]  # noqa: E731
    pd.drive(lambda: pages("d-2"), "d-2's pages")
    assert not set(pages("d-1")[0]) & set(pages("d-2")[0])
    backend.gate.set()  # healed: the write lands, then its kv_done
    pd.finish()
    assert "d-1" not in pd.decode.engine.held and decode.stats_extra()["quarantined_handoffs"] == 0
    assert pd.decode.final("d-2").error is None


def test_the_quarantine_outlasts_the_prefills_bound_on_a_write_unless_set():
    from types import SimpleNamespace

    from pdserve.worker.decode import TRANSFER_IO_TIMEOUT_S, quarantine_timeout
    assert quarantine_timeout(Envs(bootstrap_timeout=8.0), SimpleNamespace(io_timeout=30.0)) == 38.0
    assert quarantine_timeout(Envs(bootstrap_timeout=8.0), object()) == 8.0 + TRANSFER_IO_TIMEOUT_S
    assert quarantine_timeout(Envs(bootstrap_timeout=8.0, kv_quarantine_timeout=3.0), object()) == 3.0
