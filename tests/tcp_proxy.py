"""A test-owned TCP proxy that adds delay and loss to a path (this kernel has no netem).

`FaultyProxy(listen, target)` forwards every connection made to `listen` to `target`, two
threads per connection. Knobs, changed at any time with `set()`: `delay_s`, held before each
forwarded chunk (latency), and `loss`, the chance that a chunk is "lost": held `rto_s` more, as
TCP holds a segment until its retransmission. A proxy cannot drop bytes of a TCP stream without
breaking it, so loss shows as the stall a retransmission costs. `close()` stops everything.
"""

from __future__ import annotations

import random
import socket
import threading
import time

CHUNK = 16 << 10


class FaultyProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], seed: int = 0):
        self.target = target
        self.delay_s, self.loss, self.rto_s = 0.0, 0.0, 0.2
        self.forwarded = 0  # bytes, both directions
        self.stalls = 0  # "lost" chunks
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._lst = socket.create_server(listen, family=socket.AF_INET6 if ":" in listen[0] else socket.AF_INET)
        self._lst.settimeout(0.2)
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="faulty-proxy-accept")]
        self._threads[0].start()

    def set(self, delay_s: float = 0.0, loss: float = 0.0, rto_s: float = 0.2) -> None:
        self.delay_s, self.loss, self.rto_s = delay_s, loss, rto_s

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._lst.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            with self._lock:
                self._socks += [down, up]
                for a, b in ((down, up), (up, down)):
                    t = threading.Thread(target=self._pipe, args=(a, b), daemon=True, name="faulty-proxy-pipe")
                    self._threads.append(t)
                    t.start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(CHUNK)
                if not data:
                    break
                hold = self.delay_s
                with self._lock:
                    if self.loss and self._rng.random() < self.loss:
                        hold += self.rto_s
                        self.stalls += 1
                    self.forwarded += len(data)
                if hold:
                    time.sleep(hold)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # one side ended: end the other, as a direct connection would
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._lst.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in threads:
            t.join(timeout=5)
