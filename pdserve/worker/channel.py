"""The worker's end of the front <-> worker channel: ZMQ PULL in, PUSH out, pickled messages."""

from __future__ import annotations

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

    def recv_all(self, timeout_s: float) -> list:
        """Every queued message; waits up to timeout_s for the first one."""
        msgs = []
        if self.poller.poll(int(timeout_s * 1000)):
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
