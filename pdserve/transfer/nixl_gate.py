"""The nixl backend's receive-side gate: a control message is delivered only once the NIXL
notifications of the writes it names have arrived, in order per sender. Pure Python, no NIXL.

A message names the sequence numbers of the writes its sender completed to us since its last
message; each WRITE's notification carries its number (NOTIF_PREFIX + digits) and comes from
NIXL only after the bytes landed. A message still waiting after `timeout` seconds breaks its
sender's path: it and every later message from that sender are dropped, with one error logged.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.transfer.nixl")

NOTIF_PREFIX = b"pdserve-w:"
MAX_LANDED = 1 << 16  # notifications kept per sender that no message named yet


def notif_for(seq: int) -> bytes:
    """The notification payload of write number `seq`."""
    return NOTIF_PREFIX + str(seq).encode()


@dataclass
class _Held:
    sender: dict
    msg: dict
    needs: list[int]
    since: float


@dataclass
class _Sender:
    """Per sending agent: notifications not yet consumed, messages waiting for theirs."""

    landed: set[int] = field(default_factory=set)
    held: deque = field(default_factory=deque)
    broken: str | None = None


class NotifGate:
    """Messages held until their writes' notifications are in; thread-safe. `me` names the
    receiving endpoint in log lines; `name_of(sender)` a sender."""

    def __init__(self, timeout: float, me: str, name_of) -> None:
        self.timeout = timeout
        self.me = me
        self._name_of = name_of
        self._lock = threading.Lock()
        self._senders: dict[str, _Sender] = {}  # by sender agent name

    def hold(self, sender: dict, wrapped: object, now: float) -> None:
        """Queue one received control message ({"w": [seq, ...], "m": msg}) from `sender`."""
        needs = wrapped.get("w") if isinstance(wrapped, dict) else None
        msg = wrapped.get("m") if isinstance(wrapped, dict) else None
        if (not isinstance(msg, dict) or not isinstance(needs, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in needs)):
            log.warning("nixl %s: dropped a malformed control message from %s", self.me, self._name_of(sender))
            return
        with self._lock:
            s = self._senders.setdefault(str(sender.get("agent")), _Sender())
            if s.broken is None:
                s.held.append(_Held(sender, msg, needs, now))

    def release(self, notifs: dict[str, list[bytes]], now: float) -> tuple[list[tuple[dict, dict]], bool]:
        """Record `notifs` (agent name -> payloads, as NIXL's get_new_notifs gives them); return
        the messages now deliverable, in order per sender, and whether any message still waits."""
        out: list[tuple[dict, dict]] = []
        waiting = False
        with self._lock:
            for name, payloads in notifs.items():
                landed = self._senders.setdefault(name, _Sender()).landed
                for p in payloads:
                    digits = p[len(NOTIF_PREFIX):] if p.startswith(NOTIF_PREFIX) else b""
                    if digits.isdigit():
                        landed.add(int(digits))
                if len(landed) > MAX_LANDED:  # named by no message (its sender failed): forget the oldest
                    landed.difference_update(sorted(landed)[:len(landed) - MAX_LANDED])
            for name, s in list(self._senders.items()):
                while s.held and s.landed.issuperset(s.held[0].needs):
                    h = s.held.popleft()
                    s.landed.difference_update(h.needs)
                    out.append((h.sender, h.msg))
                if s.held and now - s.held[0].since > self.timeout:
                    self._break(s)
                waiting = waiting or bool(s.held)
                if not s.held and not s.landed and s.broken is None:
                    del self._senders[name]
        return out, waiting

    def _break(self, s: _Sender) -> None:
        h = s.held[0]
        missing = sorted(set(h.needs) - s.landed)
        s.broken = (f"no NIXL notification for write(s) {missing[:8]} from {self._name_of(h.sender)} "
                    f"within {self.timeout}s")
        log.error("nixl %s: %s; dropping its %d waiting message(s) and every later one", self.me, s.broken,
                  len(s.held))
        s.held.clear()
