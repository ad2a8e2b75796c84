"""The worker loop's two inboxes, both waking the same poll.

`WorkerChannel`: the worker's end of the front <-> worker channel (ZMQ PULL in, PUSH out,
pickled messages), plus a pipe any thread writes to wake the loop. `MessagePump`: a thread that
moves control messages (the decode's KvReq, the prefill's KvDone...) from a transfer backend's
inbox to the loop and wakes it through that pipe.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
from typing import TYPE_CHECKING, Callable

import zmq

if TYPE_CHECKING:  # a fake worker runs the channel without loading a transfer backend
    from ..transfer.base import TransferBackend


class WorkerChannel:
    def __init__(self, in_addr: str, out_addr: str):
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(in_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(out_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        # background threads (transfers, bootstrap lookups) wake the loop through this pipe
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)

    def wake(self) -> None:
        """Thread-safe: make a blocked recv_all return now."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is already due to wake

    def recv_all(self, timeout_s: float) -> list:
        """Every queued message; waits up to timeout_s for the first one."""
        msgs = []
        if self.poller.poll(int(timeout_s * 1000)):
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            while True:
                try:
                    msgs.append(pickle.loads(self.inbox.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return msgs

    def send(self, msg) -> None:
        self.outbox.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close()
        self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


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
