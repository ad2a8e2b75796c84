"""Shared fixtures. The tests folder is on sys.path, so helper modules (cluster, fault_tools,
handoff_harness, tiny_model, ...) import by their plain names."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from handoff_harness import THREAD_PREFIXES, WAIT_S, Link, make_link  # noqa: E402

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


