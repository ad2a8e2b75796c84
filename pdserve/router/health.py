"""Upstream health: a per-server state machine fed by probe results, and the loop that probes.

A server starts UNKNOWN (not selectable) and becomes HEALTHY on its first passed probe. After
`failure_threshold` consecutive failures it is UNHEALTHY (removed from selection) until
`success_threshold` consecutive passes bring it back. A failed leg (a connection error) makes the
router probe that server at once (`confirm`): a failed probe then takes it out of selection
without waiting for the loop, a passing one keeps it in, since a cut connection (a proxy, a load
balancer's idle timeout, a network blip) is not a dead server.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    from .upstream import Upstream

log = logging.getLogger("pdserve.router.health")


class HealthState(str, enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class ProbeEvent(enum.Enum):
    PASSED = "passed"  # a pass, not yet `success_threshold` in a row
    RECOVERED = "recovered"  # `success_threshold` passes in a row
    FAILED = "failed"  # a failure, not yet `failure_threshold` in a row
    DOWN = "down"  # `failure_threshold` failures in a row


_S, _E = HealthState, ProbeEvent
TRANSITIONS: dict[tuple[HealthState, ProbeEvent], HealthState] = {
    (_S.UNKNOWN, _E.PASSED): _S.HEALTHY,
    (_S.UNKNOWN, _E.RECOVERED): _S.HEALTHY,
    (_S.UNKNOWN, _E.FAILED): _S.UNKNOWN,
    (_S.UNKNOWN, _E.DOWN): _S.UNHEALTHY,
    (_S.HEALTHY, _E.PASSED): _S.HEALTHY,
    (_S.HEALTHY, _E.RECOVERED): _S.HEALTHY,
    (_S.HEALTHY, _E.FAILED): _S.HEALTHY,
    (_S.HEALTHY, _E.DOWN): _S.UNHEALTHY,
    (_S.UNHEALTHY, _E.PASSED): _S.UNHEALTHY,
    (_S.UNHEALTHY, _E.RECOVERED): _S.HEALTHY,
    (_S.UNHEALTHY, _E.FAILED): _S.UNHEALTHY,
    (_S.UNHEALTHY, _E.DOWN): _S.UNHEALTHY,
}


@dataclass
class HealthTracker:
    """Consecutive pass/fail counts of one server and its HealthState."""

    failure_threshold: int = 3
    success_threshold: int = 1
    state: HealthState = HealthState.UNKNOWN
    passes: int = 0
    failures: int = 0
    last_error: str = ""

    @property
    def selectable(self) -> bool:
        return self.state is HealthState.HEALTHY

    def record(self, ok: bool, error: str = "", down: bool = False) -> tuple[HealthState, HealthState]:
        """Apply one probe result; returns (old state, new state). `down`: a failure that is
        already confirmed (a failed leg, then a failed probe) counts as `failure_threshold`."""
        if ok:
            self.passes, self.failures = self.passes + 1, 0
            event = _E.RECOVERED if self.passes >= self.success_threshold else _E.PASSED
        else:
            self.passes, self.last_error = 0, error
            self.failures = max(self.failures + 1, self.failure_threshold if down else 0)
            event = _E.DOWN if self.failures >= self.failure_threshold else _E.FAILED
        old, self.state = self.state, TRANSITIONS[(self.state, event)]
        return old, self.state


Probe = Callable[["Upstream"], Awaitable[None]]


class HealthLoop:
    """Probes every server each interval (faster while some server was never seen healthy).

    `probe(upstream)` must raise on failure; its result is recorded on `upstream.health`.
    `on_change(upstream, old, new)` is called on every state change.
    """

    STARTUP_INTERVAL = 0.5

    def __init__(self, upstreams: list["Upstream"], probe: Probe, interval: float,
                 on_change: Callable[["Upstream", HealthState, HealthState], None]):
        self._upstreams = upstreams
        self._probe = probe
        self._interval = interval
        self._on_change = on_change
        self._confirming: dict[str, asyncio.Task] = {}  # url -> the probe a failed leg asked for

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(up) for up in self._upstreams))

    async def _check(self, up: "Upstream") -> None:
        try:
            await self._probe(up)
        except Exception as exc:  # any failure to probe is a failed probe
            self.record(up, False, f"{type(exc).__name__}: {exc}")
        else:
            self.record(up, True)

    def confirm(self, up: "Upstream", error: str) -> asyncio.Task:
        """A leg to `up` failed (`error`): probe it now, one probe per server at a time. A failed
        probe takes it out of selection at once; a passing one leaves it in. Await the task to
        know before picking `up` again."""
        task = self._confirming.get(up.url)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._confirm(up, error))
            self._confirming[up.url] = task
        return task

    async def _confirm(self, up: "Upstream", error: str) -> None:
        try:
            await self._probe(up)
        except Exception as exc:
            self.record(up, False, f"{error}; then a probe failed: {type(exc).__name__}: {exc}", down=True)
        else:
            self.record(up, True)

    async def close(self) -> None:
        """Cancel the probes failed legs asked for."""
        tasks = [t for t in self._confirming.values() if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def record(self, up: "Upstream", ok: bool, error: str = "", down: bool = False) -> None:
        old, new = up.health.record(ok, error, down)
        if old is not new:
            level = logging.INFO if new is HealthState.HEALTHY else logging.WARNING
            log.log(level, "%s server %s: %s -> %s %s", up.role.value, up.url, old.value, new.value,
                    up.health.last_error if not ok else "")
            self._on_change(up, old, new)

    async def wait_all_healthy(self, timeout: float) -> None:
        """Probe until every server is healthy; RuntimeError naming the rest after `timeout` s."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            await self.check_all()
            missing = [up for up in self._upstreams if not up.health.selectable]
            if not missing:
                return
            if asyncio.get_running_loop().time() >= deadline:
                raise RuntimeError(
                    f"--worker-startup-timeout-secs {timeout:g}: not healthy: " + "; ".join(
                        f"{up.role.value} {up.url} ({up.health.last_error or up.health.state.value})"
                        for up in missing))
            await asyncio.sleep(self.STARTUP_INTERVAL)

    async def run(self) -> None:
        while True:
            starting = any(up.health.state is HealthState.UNKNOWN for up in self._upstreams)
            await asyncio.sleep(min(self._interval, self.STARTUP_INTERVAL) if starting else self._interval)
            await self.check_all()
