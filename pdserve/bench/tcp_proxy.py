"""A small TCP proxy for fault benchmarks: forwards one 127.0.0.1 port to another and can
break every connection passing through it at once (`cut`), as a dropped link or a peer's crash
does to the connections it carried; new connections are accepted again right after.

One accept thread and one thread per connection direction; `close()` stops them all.
"""

from __future__ import annotations

import socket
import struct
import threading


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target = (host, target_port)
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.live: set[socket.socket] = set()
        self.cuts = 0
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name=f"tcp-proxy-{self.port}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.live.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src)
            self._drop(dst)

    def _drop(self, s: socket.socket) -> None:
        with self.lock:
            self.live.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> int:
        """Break every connection now passing through, mid-message; returns how many."""
        with self.lock:
            socks = list(self.live)
            self.live.clear()
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
        self.closed = True
        self.listener.close()
        self.cut()
        self.thread.join(timeout=5)
