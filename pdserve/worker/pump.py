"""Moves control messages from a transfer backend's inbox to the worker loop and wakes it."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from ..transfer.base import TransferBackend


class MessagePump:
    def __init__(self, backend: TransferBackend, wake: Callable[[], None]):
        self.backend = backend
        self.wake = wake
        self.inbox: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-msg-pump", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            got = self.backend.recv(0.2)
            for item in got:
                self.inbox.put(item)
            if got:
                self.wake()

    def drain(self) -> list[tuple[dict, dict]]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2)
