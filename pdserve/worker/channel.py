"""The worker's end of the front <-> worker channel: ZMQ PULL in, PUSH out, pickled messages."""

from __future__ import annotations

import os
import pickle

import zmq


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
