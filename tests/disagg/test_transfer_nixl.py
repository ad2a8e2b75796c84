"""What only the nixl transfer backend does, on two real NIXL agents (UCX) in this process: its
descriptor (agent metadata), notification gating (driven with real NIXL notifications sent by
hand, and the gate alone), descriptor checks, what close releases, the progress-thread delay (a
stand-in bindings module) and what an import failure tells the user (a stubbed import). The
contract every backend keeps (pages, messages, validation, refusals, close) is
test_transfer_contract.py. Skipped (with the reason) only when NIXL cannot be imported here.
"""

from __future__ import annotations

import base64
import os
import sys
import time
import types

import pytest

from pdserve.core.kv_layout import KVLayout
from pdserve.transfer import TransferError, create_backend, nixl_agent, nixl_gate
from pdserve.transfer import nixl as nx
from tests.harness.transfer_pools import BackendPair, Pool, recv_until  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TRANSFER_BACKEND = "nixl"  # of the `pair` the module's tests share (conftest.py)
if (_problem := nx.import_problem()) is not None:
    pytest.skip(f"nixl backend unavailable: {_problem}", allow_module_level=True)


def test_descriptor_names_agent_metadata_and_pool(pair):
    ep = pair.b_ep
    assert ep["version"] >= 1 and ep["plugins"] == ["UCX"]
    assert ep["base_ptr"] == pair.b_pool.layout.base_ptr and ep["ip"] == "127.0.0.1"
    assert ep["agent"] == f"pdserve-{ep['instance']}" != pair.a_ep["agent"]
    assert base64.b64decode(ep["agent_metadata"]) and ep["agent_metadata"] != pair.a_ep["agent_metadata"]


def test_pool_spans_merge_adjacent_regions_only():
    lay = KVLayout(base_ptr=1000, num_regions=3, num_pages=4, page_bytes=10, region_stride=40, page_size=1,
                   dtype="bfloat16")
    assert nx._pool_spans(lay) == [(1000, 120)]
    padded = KVLayout(1000, 3, 4, 10, 50, 1, "bfloat16")  # a gap after each region's pages
    assert nx._pool_spans(padded) == [(1000, 40), (1050, 40), (1100, 40)]


def test_message_waits_for_the_notification_of_its_write(pair):
    """A message naming a write whose notification has not come is held; the notification
    (sent here by hand through NIXL, as a WRITE would send it) releases it, in order."""
    pair.a.write_pages(pair.b_ep, pair.b_layout, [0], [0])  # a loads b's agent: the notification's path
    pair.a.send(pair.b_ep, {"before": 1})
    assert [m for _, m in recv_until(pair.b, 1)] == [{"before": 1}]
    out = pair.a._peer_out(pair.b_ep["agent"])
    with out.lock:
        out.done.append(10_000)  # a write numbered 10000 'completed' but its notification is not out
    pair.a.send(pair.b_ep, {"after": "write"})
    pair.a.send(pair.b_ep, {"next": 1})  # behind it on the same path
    assert pair.b.recv(0.3) == []
    pair.a._agent.send_notif(pair.b_ep["agent"], nixl_gate.notif_for(10_000))
    got = recv_until(pair.b, 2)
    assert [m for _, m in got] == [{"after": "write"}, {"next": 1}]


def test_missing_notification_drops_the_path_after_io_timeout(caplog):
    p = BackendPair("nixl", Pool(2, 4, 64, seed=5), Pool(2, 4, 64), io_timeout=0.5)
    try:
        out = p.a._peer_out(p.b_ep["agent"])
        with out.lock:
            out.done.append(77)  # never notified
        p.a.send(p.b_ep, {"lost": 1})
        with caplog.at_level("ERROR", logger="pdserve.transfer.nixl"):
            assert recv_until(p.b, 1, deadline_s=2.0) == []
        assert "no NIXL notification for write(s) [77]" in caplog.text
        assert f"nixl://127.0.0.1:{p.a_ep['port']}" in caplog.text
        p.a.send(p.b_ep, {"later": 1})  # nothing more is delivered on that path
        assert recv_until(p.b, 1, deadline_s=0.5) == []
    finally:
        p.close()


def test_descriptor_mismatches_refused_before_any_byte(fresh):
    ep, lay = fresh.b_ep, fresh.b_layout
    with pytest.raises(TransferError, match=r"uses NIXL plugins \['LIBFABRIC'\], this endpoint uses \['UCX'\]"):
        fresh.a.send({**ep, "plugins": ["LIBFABRIC"]}, {"x": 1})
    with pytest.raises(TransferError, match="needs agent"):
        fresh.a.write_pages({k: v for k, v in ep.items() if k != "agent_metadata"}, lay, [0], [0])
    with pytest.raises(TransferError, match="not the expected"):  # the peer "restarted"
        fresh.a.write_pages({**ep, "instance": "0" * 16}, lay, [0], [0])
    other_pool = Pool(4, 24, 256)  # a live peer whose descriptor is tampered with
    other = create_backend("nixl")
    other_ep, other_lay = other.start(other_pool.layout), other_pool.layout
    try:
        with pytest.raises(TransferError, match="agent_metadata is not base64"):
            fresh.a.write_pages({**other_ep, "agent_metadata": "%%%"}, other_lay, [0], [0])
        with pytest.raises(TransferError, match=r"names agent .* but its metadata is agent .*'s"):
            fresh.a.write_pages({**other_ep, "agent_metadata": ep["agent_metadata"]}, other_lay, [0], [0])
        assert not other_pool.arr.any()
    finally:
        other.close()
    assert not fresh.b_pool.arr.any()


def test_close_drops_the_agent_registration_and_remotes():
    """What the contract's close checks cannot see: a closed nixl backend holds no NIXL agent, no
    registered memory and no remote agent."""
    p = BackendPair("nixl", Pool(2, 8, 128, seed=4), Pool(2, 8, 128))
    try:
        p.a.write_pages(p.b_ep, p.b_layout, [0, 1], [3, 4])
        p.a.send(p.b_ep, {"hi": 1})
        assert [m for _, m in recv_until(p.b, 1)] == [{"hi": 1}]
        assert p.a._remotes  # b's agent, loaded for the write
        p.b.close()
        assert p.b._agent is None and p.b._reg is None
        p.a.close()
        assert p.a._remotes == {} and p.a._agent is None
    finally:
        p.close()


class _StubBindings:
    """Stands in for NIXL's bindings module: records the progress delay an agent was built with."""

    def __init__(self):
        self.delays: list[int] = []

    def nixlAgent(self, name, config):  # noqa: N802
        self.delays.append(config.pthrDelay)
        return object()


def test_agents_get_a_sleeping_progress_thread():
    """nixl_agent() sets the UCX progress thread's delay to 0 (a core spinning per agent); ours
    get PROGRESS_DELAY_US, and the module is left as it was."""
    stub = _StubBindings()

    class Agent:
        def __init__(self, name, cfg):
            self.cfg = types.SimpleNamespace(pthrDelay=0)
            api.nixlBind.nixlAgent(name, self.cfg)
            self.backends = {"UCX": 1}

    api = types.SimpleNamespace(nixlBind=stub, nixl_agent=Agent, nixl_agent_config=lambda **kw: kw,
                                nixl_thread_sync_t=types.SimpleNamespace(NIXL_THREAD_SYNC_RW="rw"))
    nixl_agent.new_agent(api, "x", ("UCX",))
    assert stub.delays == [nixl_agent.PROGRESS_DELAY_US] and api.nixlBind is stub


def test_ucx_ib_modules_off_only_without_rdma_devices(monkeypatch, tmp_path):
    monkeypatch.delenv("UCX_MODULES", raising=False)
    monkeypatch.setattr(os.path, "isdir", lambda p: False)
    nixl_agent.set_env_defaults()
    assert os.environ["UCX_MODULES"] == "^ib"
    monkeypatch.setenv("UCX_MODULES", "all")  # the user's choice stands
    nixl_agent.set_env_defaults()
    assert os.environ["UCX_MODULES"] == "all"


class _BlockApiImport:
    """A meta-path finder that makes every NIXL API module unimportable."""

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_import_errors_say_what_to_install(monkeypatch):
    for mod in list(sys.modules):
        if mod.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "meta_path", [_BlockApiImport(), *sys.meta_path])
    with pytest.raises(TransferError, match=r"needs NIXL's Python API: pip install --no-deps nixl-cu12==1\.5\.1"):
        create_backend("nixl")
    assert "nixl-cu12" in nx.import_problem()


def _gate(timeout: float = 5.0) -> nixl_gate.NotifGate:
    return nixl_gate.NotifGate(timeout, "me", lambda sender: sender["agent"])


def test_gate_delivers_in_order_once_named_notifications_are_in():
    g, a, b = _gate(), {"agent": "A"}, {"agent": "B"}
    g.hold(a, {"w": [0, 1], "m": {"a": 1}}, now=0.0)
    g.hold(a, {"w": [], "m": {"a": 2}}, now=0.0)  # behind a's first message
    g.hold(b, {"w": [], "m": {"b": 1}}, now=0.0)  # another sender is not held up by a
    assert g.release({}, now=0.1) == ([(b, {"b": 1})], True)
    assert g.release({"A": [nixl_gate.notif_for(1), b"not ours"]}, now=0.2) == ([], True)
    assert g.release({"A": [nixl_gate.notif_for(0)]}, now=0.3) == ([(a, {"a": 1}), (a, {"a": 2})], False)
    # a notification that came before its message is kept for it
    assert g.release({"A": [nixl_gate.notif_for(2)]}, now=0.4) == ([], False)
    g.hold(a, {"w": [2], "m": {"a": 3}}, now=0.5)
    assert g.release({}, now=0.6) == ([(a, {"a": 3})], False)


def test_gate_drops_malformed_messages_and_breaks_a_path_on_timeout(caplog):
    g, a = _gate(timeout=1.0), {"agent": "A"}
    with caplog.at_level("WARNING", logger="pdserve.transfer.nixl"):
        for bad in ({"m": {"x": 1}}, {"w": [True], "m": {}}, {"w": [1], "m": "text"}, ["w"]):
            g.hold(a, bad, now=0.0)
    assert g.release({}, now=0.0) == ([], False) and caplog.text.count("malformed control message from A") == 4
    g.hold(a, {"w": [5], "m": {"x": 1}}, now=0.0)
    with caplog.at_level("ERROR", logger="pdserve.transfer.nixl"):
        assert g.release({}, now=1.5) == ([], False)
    assert "no NIXL notification for write(s) [5] from A within 1.0s" in caplog.text
    g.hold(a, {"w": [], "m": {"later": 1}}, now=2.0)
    assert g.release({"A": [nixl_gate.notif_for(5)]}, now=2.0) == ([], False)  # the path stays broken


def test_recv_with_no_wait_takes_what_has_arrived(pair):
    pair.a.write_pages(pair.b_ep, pair.b_layout, [0], [0])
    pair.a.send(pair.b_ep, {"poll": 1})
    got: list = []
    end = time.monotonic() + 15
    while not got and time.monotonic() < end:
        got = pair.b.recv(0)  # never blocks, yet sees the message once its write's notification is in
        time.sleep(0.01)
    assert [m for _, m in got] == [{"poll": 1}]
