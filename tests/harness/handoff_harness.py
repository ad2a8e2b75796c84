"""The handoff harness the disagg unit tests share: numpy KV pools behind FakeBackends on one
FakeFabric, a PrefillSender and a DecodeReceiver wired by hand (`Link`) on a FakePrefillLink,
message pumps and polls with deadlines. Fixtures over it live in tests/conftest.py."""


from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np

from pdserve.core.kv_layout import KVLayout
from pdserve.disagg import wire
from pdserve.disagg.bootstrap_table import RankInfo
from pdserve.disagg.decode_events import (
    CancelResolve,
    GiveUp,
    Invalidate,
    PeerAlive,
    PeerGone,
    RankResolved,
    Resolve,
    Resolved,
)
from pdserve.disagg.handoff import HandoffState
from pdserve.disagg.kv_receiver import DecodeReceiver, ReceiverLimits
from pdserve.disagg.kv_sender import PrefillSender
from pdserve.disagg.link_api import Inbox, LinkEffect, PeerLink
from pdserve.disagg.local_facts import LocalFacts
from pdserve.disagg.prefill_events import PrefillFacts
from pdserve.transfer.fake import FakeBackend, FakeFabric

S = HandoffState
PAGE_SIZE, PAGES, PAGE_BYTES, REGIONS = 4, 16, 32, 4
FP = {"architecture": "LlamaForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
ADDR = "127.0.0.1:8998"
ROOM = 1234567
PROMPT = 10  # tokens -> 3 pages
SRC = [1, 2, 5]  # the prefill's pages of the prompt
AUX = PrefillFacts(first_token=42, first_logprob=-0.25, input_logprobs=None, prompt_len=PROMPT)
WAIT_S = 5.0
THREAD_PREFIXES = ("kv-send", "kv-recv", "kv-msg-pump", "resolve", "dp-rank-query", "pd-heartbeat",
                   "pd-link", "bootstrap-http")


def make_memory(seed: int | None) -> tuple[np.ndarray, KVLayout]:
    n = REGIONS * PAGES * PAGE_BYTES
    arr = (np.zeros(n, np.uint8) if seed is None
           else np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8))
    layout = KVLayout(arr.ctypes.data, REGIONS, PAGES, PAGE_BYTES, PAGES * PAGE_BYTES, PAGE_SIZE, "float32")
    return arr, layout


def pages_of(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(REGIONS, PAGES, PAGE_BYTES)


class GatedBackend(FakeBackend):
    """Page writes wait for `gate` (open by default), so a test can act while a write job runs."""

    def __init__(self, fabric: FakeFabric):
        super().__init__(fabric)
        self.gate = threading.Event()
        self.gate.set()
        self.writing = threading.Event()

    def _copy(self, peer, copies):
        self.writing.set()
        assert self.gate.wait(30), "test never opened the write gate"
        return super()._copy(peer, copies)


class PagePool:
    """The decode's `reserve` callback over a free list; None when too few pages are free."""

    def __init__(self, free: list[int]):
        self.free = list(free)
        self.held: dict[str, list[int]] = {}
        self.calls: list[tuple[str, int]] = []

    def __call__(self, rid: str, num_tokens: int) -> list[int] | None:
        self.calls.append((rid, num_tokens))
        n = -(-num_tokens // PAGE_SIZE)
        if len(self.free) < n:
            return None
        self.held[rid], self.free = self.free[:n], self.free[n:]
        return self.held[rid]

    def release(self, rid: str) -> None:
        self.free.extend(self.held.pop(rid))


class FakePrefillLink(PeerLink):
    """A decode's link to its prefills, by hand: it records the effects it is handed and posts
    into the receiver's inbox what the test says it learned (`resolved`, `gone`, `alive`)."""

    def __init__(self) -> None:
        super().__init__()
        self.inbox: Inbox | None = None
        self.resolves: list[tuple[str, int, int | None]] = []
        self.cancels: list[tuple[str, int]] = []
        self.invalidated: list[str] = []
        self.given_up: list[tuple[str, int, str]] = []

    def bind(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def execute(self, effect: LinkEffect) -> None:
        if isinstance(effect, Resolve):
            self.resolves.append((effect.addr, effect.room, effect.hint))
        elif isinstance(effect, CancelResolve):
            self.cancels.append((effect.addr, effect.room))
        elif isinstance(effect, Invalidate):
            self.invalidated.append(effect.addr)
        elif isinstance(effect, GiveUp):
            self.given_up.append((effect.addr, effect.room, effect.reason))
        else:
            raise TypeError(effect)

    def resolved(self, res: Resolved) -> None:
        self.inbox.post(RankResolved(res))

    def gone(self, addr: str, reason: str, ranks: frozenset[int] | None = None) -> None:
        self.inbox.post(PeerGone(addr, reason, ranks))

    def alive(self, addr: str, instance: str) -> None:
        self.inbox.post(PeerAlive(addr, instance))


def pump(backend: FakeBackend, handler: Callable[[dict, dict], None], n: int = 1,
         timeout: float = WAIT_S) -> list[dict]:
    """Hand the next `n` control messages arriving at `backend` to `handler`; return them."""
    got: list[dict] = []
    end = time.monotonic() + timeout
    while len(got) < n:
        left = end - time.monotonic()
        assert left > 0, f"expected {n} control messages within {timeout}s, got {got}"
        for sender, msg in backend.recv(min(left, 0.5)):
            got.append(msg)
            handler(sender, msg)
    return got


def poll_until(poll: Callable[[], list], n: int = 1, timeout: float = WAIT_S) -> list:
    """Call `poll` until it has returned `n` finished rooms in all."""
    out: list = []
    end = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < end, f"expected {n} finished rooms within {timeout}s, got {out}"
        out.extend(poll())
        if len(out) < n:
            time.sleep(0.002)
    return out


@dataclass
class Link:
    """One prefill worker's PrefillSender and one decode worker's DecodeReceiver, wired by hand."""

    fabric: FakeFabric
    prefill_be: GatedBackend
    decode_be: FakeBackend
    p_mem: np.ndarray
    d_mem: np.ndarray
    sender: PrefillSender
    receiver: DecodeReceiver
    prefills: PeerLink  # the receiver's link: a FakePrefillLink unless make_link was given one
    pool: PagePool
    p_local: dict  # the prefill's facts a KvReq carries, in their wire spelling (req_facts)
    d_local: dict  # the decode's
    wakes: list = field(default_factory=list)

    @property
    def resolves(self) -> list:
        return self.prefills.resolves

    @property
    def cancels(self) -> list:
        return self.prefills.cancels

    def resolved(self, room: int = ROOM, rank: int = 0, error: str | None = None) -> Resolved:
        ep = self.p_local["endpoint"]
        info = RankInfo(dp_rank=rank, dp_size=1, rank_ip=ep["ip"], rank_port=ep["port"],
                        page_size=PAGE_SIZE, kv_cache_dtype="float32", load_balance_method="auto",
                        fingerprint=FP, endpoint=ep, transfer_backend="fake")
        if error is not None:
            return Resolved(room, ADDR, error=error)
        return Resolved(room, ADDR, rank, "single", info, "inst-1")

    def to_prefill(self, n: int = 1) -> list[dict]:
        return pump(self.prefill_be, self.sender.on_message, n)

    def to_decode(self, n: int = 1) -> list[dict]:
        return pump(self.decode_be, self.receiver.on_message, n)

    def decode_sends_req(self, room: int = ROOM, prompt_len: int = PROMPT, addr: str = ADDR) -> dict:
        """accept + resolution on the decode; returns the kv_req once the prefill got it."""
        self.receiver.accept(room, f"d-{room}", addr, prompt_len, None)
        self.prefills.resolved(self.resolved(room))
        assert self.receiver.poll() == []
        [msg] = pump(self.prefill_be, lambda s, m: None)
        assert msg["t"] == wire.KV_REQ and msg["room"] == room
        return msg

    def deliver_req(self, room: int = ROOM, prompt_len: int = PROMPT) -> None:
        """Like decode_sends_req, but the prefill handles the kv_req."""
        self.receiver.accept(room, f"d-{room}", ADDR, prompt_len, None)
        self.prefills.resolved(self.resolved(room))
        assert self.receiver.poll() == []
        [msg] = self.to_prefill()
        assert msg["t"] == wire.KV_REQ
        self.wait_decode_state(room, S.WAITING_FOR_INPUT)

    def wait_decode_state(self, room: int, state: HandoffState) -> None:
        end = time.monotonic() + WAIT_S
        while self.receiver.rooms[room].handoff.state is not state:
            assert time.monotonic() < end, f"room {room} never reached {state}"
            assert self.receiver.poll() == []
            time.sleep(0.002)

    def prefill_done(self, n: int = 1) -> list:
        return poll_until(self.sender.poll, n)

    def decode_done(self, n: int = 1) -> list:
        return poll_until(self.receiver.poll, n)

    def close(self) -> None:
        self.prefill_be.gate.set()
        self.sender.close(wait=True)
        self.receiver.close(wait=True)
        self.prefill_be.close()
        self.decode_be.close()


def make_link(*, decode_local: dict | None = None, free: list[int] | None = None,
              bootstrap_timeout: float = 30.0, waiting_timeout: float = 30.0,
              abort_grace: float = 5.0, prefills: PeerLink | None = None) -> Link:
    fabric = FakeFabric()
    p_mem, p_layout = make_memory(seed=7)
    d_mem, d_layout = make_memory(seed=None)
    pbe, dbe = GatedBackend(fabric), FakeBackend(fabric)
    p_ep, d_ep = pbe.start(p_layout), dbe.start(d_layout)
    p_facts = LocalFacts.of("fake", p_layout, FP, p_ep)
    d_facts = dataclasses.replace(LocalFacts.of("fake", d_layout, FP, d_ep), **(decode_local or {}))
    pool = PagePool([9, 3, 4, 12, 13, 14, 0, 6, 7, 8] if free is None else free)
    wakes: list = []
    sender = PrefillSender(pbe, 0, p_facts, bootstrap_timeout=bootstrap_timeout,
                           wake=lambda: wakes.append("prefill"))
    prefills = prefills or FakePrefillLink()
    receiver = DecodeReceiver(dbe, 1, d_facts, link=prefills, reserve=pool, wake=lambda: wakes.append("decode"),
                              limits=ReceiverLimits(waiting_timeout=waiting_timeout, abort_grace=abort_grace))
    return Link(fabric, pbe, dbe, p_mem, d_mem, sender, receiver, prefills, pool,
                req_facts(p_facts), req_facts(d_facts), wakes)


def facts_of(done: wire.KvDone) -> PrefillFacts:
    """The PrefillFacts a KvDone carries (its fields of the same names)."""
    return PrefillFacts(**{f.name: getattr(done, f.name) for f in dataclasses.fields(PrefillFacts)})


def req_facts(local: LocalFacts) -> dict:
    """What a KvReq carries of a worker's LocalFacts, by KvReq field name, as the wire spells it."""
    keys = ("layout", "endpoint", "page_size", "kv_dtype", "fingerprint", "backend")
    return {k: msgspec.to_builtins(getattr(local, k)) for k in keys}




def assert_pages_landed(lk: Link, src: list[int], dst: list[int]) -> None:
    p, d = pages_of(lk.p_mem), pages_of(lk.d_mem)
    for s, t in zip(src, dst):
        assert np.array_equal(d[:, t], p[:, s]), f"decode page {t} != prefill page {s}"
    untouched = [q for q in range(PAGES) if q not in dst]
    assert not d[:, untouched].any(), "bytes landed outside the destination pages"


def assert_idle(lk: Link) -> None:
    assert lk.sender.inflight() == 0 and lk.receiver.inflight() == 0
    assert not lk.sender.early
    assert lk.prefills.watched() == set()


