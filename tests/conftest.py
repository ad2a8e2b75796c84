"""Shared fixtures. The repo root is on sys.path, so the helpers import as `tests.harness.<module>`
(cluster, fault_tools, handoff_harness, tiny_model, ...: see tests/harness/__init__.py), the name
servers load the fake workers by as well."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness.handoff_harness import THREAD_PREFIXES, WAIT_S, Link, make_link  # noqa: E402


@pytest.fixture
def no_stray_threads():
    """Every thread a test starts (senders, receivers, resolvers, servers) is stopped by its end."""
    before = set(threading.enumerate())
    yield
    end = time.monotonic() + WAIT_S
    while True:
        stray = [t.name for t in set(threading.enumerate()) - before
                 if t.is_alive() and t.name.startswith(THREAD_PREFIXES)]
        if not stray or time.monotonic() > end:
            break
        time.sleep(0.01)
    assert not stray, f"threads left running: {stray}"


@pytest.fixture
def link(request) -> Link:
    lk = make_link()
    request.addfinalizer(lk.close)
    return lk


@pytest.fixture(scope="module")
def legs():
    """Requests kept in flight on background threads (fault_tools.Legs), one pool per module."""
    from tests.harness.fault_tools import Legs

    pool = Legs()
    yield pool
    pool.close()


BORROWERS = pytest.StashKey()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: count the modules that will run
def pytest_collection_modifyitems(config, items):
    from tests.harness.shared_servers import count_borrowers

    modules = {id(m): m for m in (getattr(i, "module", None) for i in items) if m is not None}
    config.stash[BORROWERS] = count_borrowers(modules.values())


@pytest.fixture(scope="session")
def shared_servers(request, tmp_path_factory):
    """Plain servers, started once and lent to the e2e modules that declare them (see
    shared_servers.py); each stopped after its last borrower, the rest at the session's end."""
    from tests.harness.fault_tools import shared_tiny_model
    from tests.harness.shared_servers import SharedServers

    pool = SharedServers(lambda: shared_tiny_model(tmp_path_factory),
                         str(tmp_path_factory.mktemp("shared_servers")), request.config.stash.get(BORROWERS, None))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory) -> str:
    """One build folder for our C kernels per session: the tests that only need a built kernel
    compile each source once, not once per module (the build-and-cache rules have tests of
    their own, on their own folders)."""
    return str(tmp_path_factory.mktemp("kernels"))
