"""Servers started once per pytest session and lent to every e2e module that asks for the same
kind (role, dp, flags, env, instance, model; by default the shared tiny model): a server start
(a torch import per DP worker) is most of a small module's time, and many modules want the same
plain servers.

A module declares what it borrows in a module-level `LENT` (name -> ServerKind) and passes it
to `borrow`; conftest counts the modules that will run with each kind, so a server stops once
its last borrower is done (idle servers still cost a little CPU). A lent server is alive, idle
and has an empty prefix cache when a module gets it, and must be idle again when the module
gives it back. Borrowers never kill, restart, slow or reconfigure one: a test that does must
start its own `cluster.Server`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

from .cluster import Server, stop_all
from .fault_tools import flush_cache

IDLE_S = 20.0  # a lent server's last requests have had the module's own deadlines to end
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ServerKind:
    """What makes two lent servers interchangeable; `instance` tells apart servers a module
    wants several of (two prefills of the same kind are two processes)."""

    role: str
    dp: int = 1
    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    instance: int = 0
    model: str = ""  # "": the session's shared tiny model; else a name resolve_model knows


class SharedServers:
    """The session's lent servers, by kind; `lend` starts the missing ones (all at once),
    `give_back` stops those no later module will borrow, `stop_all` the rest at the end."""

    def __init__(self, tiny_model: Callable[[], str], log_dir: str, borrowers: Counter | None = None):
        self._tiny_model, self._log_dir = tiny_model, log_dir
        self._borrowers = borrowers if borrowers is not None else Counter()  # kind -> modules left
        self._started: dict[ServerKind, Server] = {}
        self._ready: set[ServerKind] = set()

    @property
    def model_dir(self) -> str:
        """The shared tiny model (built on first use: modules of other models need none)."""
        return self._tiny_model()

    def _model(self, kind: ServerKind) -> str:
        if not kind.model:
            return self.model_dir
        from pdserve.core.envs import Envs
        from pdserve.model_files import resolve_model

        return resolve_model(kind.model, Envs.read().cache_dir)

    def lend(self, kinds: dict[str, ServerKind]) -> dict[str, Server]:
        """name -> a live, idle server with an empty prefix cache, for each kind asked."""
        for kind in kinds.values():  # launch every missing one before waiting on any
            if kind not in self._started:
                self._started[kind] = Server(kind.role, self._model(kind), kind.dp, list(kind.extra),
                                             dict(kind.env), self._log_dir)
        lent = {}
        for name, kind in kinds.items():
            srv = self._started[kind]
            if kind not in self._ready:
                srv.wait_ready()
                self._ready.add(kind)
            if srv.proc.poll() is not None:
                raise RuntimeError(f"shared {kind} exited ({srv.proc.returncode}): a module "
                                   f"killed a lent server\n{srv.tail()}")
            flush_cache(srv)
            srv.wait_idle(IDLE_S)
            lent[name] = srv
        return lent

    def give_back(self, kinds: dict[str, ServerKind]) -> None:
        """Check that a module left its servers alive and idle for the next one; stop the ones
        no module still to run will borrow."""
        done = []
        for name, kind in kinds.items():
            srv = self._started[kind]
            if srv.proc.poll() is not None:
                raise AssertionError(f"lent server {name} ({kind}) exited: only own servers may "
                                     f"be killed\n{srv.tail()}")
            srv.wait_idle(IDLE_S)
            self._borrowers[kind] -= 1
            if self._borrowers[kind] <= 0:
                done.append(kind)
        self._stop(done)

    def stop_all(self) -> None:
        self._stop(list(self._started))

    def _stop(self, kinds: list[ServerKind]) -> None:
        stop_all([self._started.pop(k) for k in kinds])
        self._ready.difference_update(kinds)


def count_borrowers(modules: Iterable[object]) -> Counter:
    """kind -> how many of these test modules declare it in their LENT."""
    counts: Counter = Counter()
    for module in modules:
        counts.update(set(getattr(module, "LENT", {}).values()))
    return counts


COLOCATED = ServerKind("colocated")
PREFILL = ServerKind("prefill")
DECODE = ServerKind("decode")
PREFILL_DP2 = ServerKind("prefill", dp=2)
DECODE_DP2 = ServerKind("decode", dp=2)
DEFAULT_MODEL_FLAGS = ("--page-size", "16", "--max-total-tokens", "4096")


def default_model_kind(role: str, dp: int = 1) -> ServerKind:
    """A server of the default model (float32) as the modules that compare PD with colocated on
    it start theirs, so they get the same processes."""
    return ServerKind(role, dp, DEFAULT_MODEL_FLAGS, model=DEFAULT_MODEL)


@contextmanager
def borrow(shared: SharedServers, kinds: dict[str, ServerKind], own: dict[str, Server] | None = None):
    """For a module fixture: the lent servers (kinds: the module's LENT) plus the module's own
    (already launched, so they start while the lent ones are readied), all ready, as name ->
    server; at the end the own ones are stopped and the lent ones given back."""
    own = own or {}
    try:
        servers = shared.lend(kinds)
        for srv in own.values():
            srv.wait_ready()
        yield {**servers, **own}
    finally:
        stop_all(list(own.values()))
    shared.give_back(kinds)
