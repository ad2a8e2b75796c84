"""Fixtures of the transfer-backend modules (test_transfer_*.py)."""

from __future__ import annotations

import pytest

from tests.harness.transfer_pools import BackendPair, Pool


@pytest.fixture(scope="module")
def pair(request):
    """Backend a (16 pages, filled) writes into backend b (24 pages: its regions sit at another
    stride), shared by a module's tests that leave them working. Their kind is the test's
    parameter (`parametrize("pair", [...], indirect=True)`), else the module's TRANSFER_BACKEND."""
    backend = getattr(request, "param", None) or request.module.TRANSFER_BACKEND
    p = BackendPair(backend, Pool(4, 16, 256, seed=1), Pool(4, 24, 256))
    yield p
    p.close()


@pytest.fixture
def fresh(pair):
    """The shared pair with b's pool zeroed again."""
    pair.b_pool.arr[:] = 0
    return pair
