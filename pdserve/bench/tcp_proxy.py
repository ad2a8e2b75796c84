"""A TCP proxy that breaks the path it carries, for fault benchmarks and tests.

`TcpProxy(target, listen=("127.0.0.1", 0))` forwards every connection made to `listen` (port 0:
a free one, then `.port`) to `target`, with two threads per connection. Faults, at any time:
- `cut()` breaks every connection passing through at once, with a reset, as a dropped link or a
  crashed peer does to the connections it carried; new connections are accepted right after;
- `set(delay_s, loss, rto_s)`: `delay_s` is held before each forwarded chunk (latency); `loss`
  is the chance a chunk is "lost", held `rto_s` more as TCP holds a segment until its
  retransmission (a proxy cannot drop bytes of a stream without breaking it, so loss shows as
  the stall a retransmission costs; for kernels without netem).
Counters: `forwarded` bytes (both directions), `stalls` ("lost" chunks), `cuts`. `close()` stops
every thread it started, each within a deadline.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

CHUNK = 16 << 10  # the unit that latency and loss apply to
ACCEPT_POLL_S = 0.2  # how soon the accept thread sees close()
JOIN_S = 5.0


class TcpProxy:
    def __init__(self, target: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0), seed: int = 0):
        self.target = target
        self.delay_s, self.loss, self.rto_s = 0.0, 0.0, 0.2
        self.forwarded = 0
        self.stalls = 0
        self.cuts = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._pipes: list[threading.Thread] = []
        self._stop = threading.Event()
        self._listener = socket.create_server(listen, family=socket.AF_INET6 if ":" in listen[0] else socket.AF_INET)
        self._listener.settimeout(ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name=f"tcp-proxy-{self.port}", daemon=True)
        self._acceptor.start()

    def set(self, delay_s: float = 0.0, loss: float = 0.0, rto_s: float = 0.2) -> None:
        """Latency and loss from now on (the defaults: none)."""
        self.delay_s, self.loss, self.rto_s = delay_s, loss, rto_s

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
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
            down.settimeout(None)
            with self._lock:
                self._live.update((down, up))
                self._pipes = [t for t in self._pipes if t.is_alive()]
                for src, dst in ((down, up), (up, down)):
                    t = threading.Thread(target=self._pipe, args=(src, dst), daemon=True, name="tcp-proxy-pipe")
                    self._pipes.append(t)
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
        finally:  # one side ended: end the other, as a direct connection would
            for s in (src, dst):
                self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            self._live.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> int:
        """Break every connection now passing through, mid-message; returns how many."""
        with self._lock:
            socks = list(self._live)
            self._live.clear()
            self.cuts += 1
        for s in socks:
            try:  # linger 0: close sends a reset; shutting the read side wakes its pipe thread
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            s.close()
        return len(socks) // 2

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self.cut()
        self._acceptor.join(JOIN_S)
        with self._lock:
            pipes = list(self._pipes)
        for t in pipes:
            t.join(JOIN_S)
