"""The real DP worker (`python -m pdserve.worker`) with knobs that widen fault windows (tests only).

Run as `python -m tests.harness.slow_worker ...` with the worker's own arguments (a front started with
`--worker-module tests.harness.slow_worker`). The knobs live in the JSON file named by
SLOW_WORKER_CONTROL and are re-read when it changes, so one server can be fast for set-up and
slow while a test injects a fault:
  step_s      seconds slept before every engine step that has work (prefill chunks, decode steps)
  transfer_s  seconds a tcp page write pauses half-way (half of the runs landed, half not)
A missing or unreadable file means no delay.
"""

from __future__ import annotations

import json
import os
import time

from pdserve.engine.engine import Engine
from pdserve.transfer.tcp import TcpBackend


class Knobs:
    def __init__(self, path: str | None):
        self.path = path
        self._mtime: float | None = None
        self._values: dict = {}

    def get(self, key: str) -> float:
        if not self.path:
            return 0.0
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime != self._mtime:
                with open(self.path) as f:
                    self._values = json.load(f)
                self._mtime = mtime
        except (OSError, ValueError):
            self._values = {}
        return float(self._values.get(key, 0.0))


KNOBS = Knobs(os.environ.get("SLOW_WORKER_CONTROL"))
_step = Engine.step
_copy = TcpBackend._copy


def slow_step(self):
    if self.has_work():
        delay = KNOBS.get("step_s")
        if delay > 0:
            time.sleep(delay)
    return _step(self)


def slow_copy(self, peer, copies):
    delay = KNOBS.get("transfer_s")
    if delay <= 0 or len(copies) < 2:
        return _copy(self, peer, copies)
    half = len(copies) // 2
    started, _ = _copy(self, peer, copies[:half])
    time.sleep(delay)
    _, finished = _copy(self, peer, copies[half:])
    return started, finished


Engine.step = slow_step
TcpBackend._copy = slow_copy

if __name__ == "__main__":
    from pdserve.worker.__main__ import main

    main()
