"""The fake backend's failure knobs, the registry, and the shared planning helpers in base.py.
(The contract tests shared with tcp run against fake in test_transfer_tcp.py.)"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from pdserve.core.kv_layout import KVLayout
from pdserve.core.pd_vocab import KvDtype
from pdserve.transfer import (
    TransferError,
    backend_class,
    backend_names,
    create_backend,
)
from pdserve.transfer.base import joint_runs, plan_copies
from pdserve.transfer.fake import FakeBackend, FakeFabric

pytestmark = pytest.mark.timeout(30)


def make_pool(pages: int = 8, page_bytes: int = 64, regions: int = 2, seed: int | None = None):
    n = regions * pages * page_bytes
    arr = np.zeros(n, np.uint8) if seed is None else np.random.default_rng(seed).integers(1, 256, n, np.uint8)
    layout = KVLayout(arr.ctypes.data, regions, pages, page_bytes, pages * page_bytes, 16, "float32")
    return arr, layout


@pytest.fixture
def fab(request):
    fabric = FakeFabric()
    (sa, la), (da, ld) = make_pool(seed=1), make_pool()
    a, b = FakeBackend(fabric), FakeBackend(fabric)
    request.addfinalizer(a.close)
    request.addfinalizer(b.close)
    return fabric, a, a.start(la), sa, b, b.start(ld), da, ld


def test_fail_writes_fires_once_and_moves_nothing(fab):
    _, a, _, _, b, b_ep, dst, lay = fab
    a.faults.fail_writes = 1
    with pytest.raises(TransferError, match="injected write failure"):
        a.write_pages(b_ep, lay, [0, 1], [0, 1])
    assert not dst.any()
    assert a.write_pages(b_ep, lay, [0, 1], [0, 1]).bytes == 2 * 2 * 64
    assert dst.any()


def test_fail_and_lose_sends(fab):
    _, a, _, _, b, b_ep, _, _ = fab
    a.faults.fail_sends = 1
    a.faults.lose_sends = 1
    with pytest.raises(TransferError, match="injected send failure"):
        a.send(b_ep, {"n": 1})
    a.send(b_ep, {"n": 2})  # lost without an error, as a dead link would
    a.send(b_ep, {"n": 3})
    assert [m for _, m in b.recv(0.5)] == [{"n": 3}]


def test_delay_slows_sends(fab):
    _, a, _, _, b, b_ep, _, _ = fab
    a.faults.delay_s = 0.05
    t0 = time.monotonic()
    a.send(b_ep, {"slow": True})
    assert time.monotonic() - t0 >= 0.05
    assert b.recv(0.5) == [(a.endpoint, {"slow": True})]


def test_dropped_peer_is_unreachable_both_ways(fab):
    fabric, a, a_ep, _, b, b_ep, _, lay = fab
    fabric.drop(b_ep)
    with pytest.raises(TransferError, match="gone"):
        a.send(b_ep, {"x": 1})
    with pytest.raises(TransferError, match="gone"):
        a.write_pages(b_ep, lay, [0], [0])
    with pytest.raises(TransferError, match="dropped"):
        b.send(a_ep, {"x": 1})


def test_restarted_instance_refused(fab):
    _, a, _, _, b, b_ep, _, _ = fab
    with pytest.raises(TransferError, match="restarted"):
        a.send({**b_ep, "instance": "0123"}, {"x": 1})


def test_separate_fabrics_do_not_see_each_other():
    _, la = make_pool()
    a, b = FakeBackend(), FakeBackend()
    try:
        a.start(la)
        b_ep = b.start(la)
        with pytest.raises(TransferError, match="no such endpoint"):
            a.send({**b_ep, "port": 99}, {"x": 1})
    finally:
        a.close()
        b.close()


def test_unserializable_message_rejected(fab):
    _, a, _, _, _, b_ep, _, _ = fab
    with pytest.raises(TransferError, match="not serializable"):
        a.send(b_ep, {"x": object()})


def test_write_before_start_and_after_close(fab):
    _, a, _, _, _, b_ep, _, lay = fab
    with pytest.raises(TransferError, match="before start"):
        FakeBackend().write_pages(b_ep, lay, [0], [0])
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.send(b_ep, {"x": 1})


def test_registry():
    assert {"tcp", "fake"} <= set(backend_names())
    assert backend_class("fake") is FakeBackend
    assert isinstance(create_backend("fake", fabric=FakeFabric()), FakeBackend)
    with pytest.raises(TransferError, match="unknown transfer backend 'rdma'; known: .*tcp"):
        backend_class("rdma")


def test_a_layout_refuses_what_no_pool_can_be():
    _, la = make_pool()
    assert la.dtype is KvDtype.FLOAT32  # a dtype name is parsed
    for field, bad in (("num_pages", -1), ("page_bytes", "64"), ("region_stride", True), ("page_size", 0)):
        with pytest.raises(ValueError, match=f"KV layout {field}={bad!r}"):
            dataclasses.replace(la, **{field: bad})
    with pytest.raises(ValueError, match="unknown KV cache dtype 'float64'"):
        dataclasses.replace(la, dtype="float64")


def test_joint_runs_need_both_sides_contiguous():
    assert joint_runs([0, 1, 2, 5, 6], [3, 4, 9, 10, 11]) == [(0, 3, 2), (2, 9, 1), (5, 10, 2)]
    assert joint_runs([], []) == []


def test_plan_copies_offsets_and_numpy_indices():
    _, la = make_pool(pages=8, page_bytes=64, regions=2)
    copies = plan_copies(la, la, list(np.array([1, 2])), [6, 7], "peer")
    assert [(c.region, c.src_offset, c.dst_offset, c.nbytes) for c in copies] == [
        (0, 64, 6 * 64, 128), (1, 512 + 64, 512 + 6 * 64, 128)]
    with pytest.raises(TransferError, match="must be integers"):
        plan_copies(la, la, [1.0], [2], "peer")


def test_transfer_package_is_torch_free():
    import subprocess
    import sys
    code = ("import sys, pdserve.transfer, pdserve.transfer.tcp, pdserve.transfer.fake; "
            "assert 'torch' not in sys.modules, 'pdserve.transfer imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
