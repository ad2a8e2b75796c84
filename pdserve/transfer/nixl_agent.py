"""Loading NIXL and building the nixl backend's agents: which module to import, what to install
when it is missing, the UCX defaults set before it loads, and an agent whose UCX progress thread
sleeps instead of spinning. No pdserve state; nixl.py owns the agents it gets from here.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading

from .base import TransferError

API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # the meta package, then its wheels
INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1 (as scripts/setup.sh does)"
# UCX's progress thread sleeps in poll() and wakes on events; this bounds its periodic wake-up.
# nixl_agent() sets 0, which spins a core per agent.
PROGRESS_DELAY_US = 2000
_AGENT_LOCK = threading.Lock()  # agent construction swaps the bindings module seen by nixl_agent()


def set_env_defaults() -> None:
    """Defaults set before NIXL loads UCX, each only where the user set nothing.

    UCX_MODULES=^ib where the machine has no RDMA device: UCX's ib transports have nothing to
    drive there, and the libnl they pull in (bundled in nixl-cu12 1.5.1) segfaults at exit."""
    ib = "/sys/class/infiniband"
    if "UCX_MODULES" not in os.environ and not (os.path.isdir(ib) and os.listdir(ib)):
        os.environ["UCX_MODULES"] = "^ib"


def import_api():
    """NIXL's Python API module (nixl_agent and friends); TransferError saying what to install."""
    set_env_defaults()
    tops = {m.split(".")[0] for m in API_MODULES}
    for name in API_MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in tops:
                continue
            raise TransferError(f"the nixl transfer backend cannot import {name}: {e}") from None
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs every agent at INFO to stdout
        return api
    raise TransferError(f"the nixl transfer backend needs NIXL's Python API: {INSTALL_HINT} "
                        f"(none of {', '.join(API_MODULES)} imports)")


def import_problem() -> str | None:
    """Why the nixl backend cannot be used on this machine, or None if it can."""
    try:
        import_api()
    except TransferError as e:
        return e.message
    return None


class _BindingsShim:
    """NIXL's bindings module as nixl_agent() sees it while it builds one agent: the same module,
    except that the agent config gets our progress-thread delay (nixl_agent() hard-codes 0)."""

    def __init__(self, real, delay_us: int):
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - the binding's name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def new_agent(api, name: str, plugins: tuple[str, ...]):
    """A NIXL agent with `plugins`, a sleeping progress thread and thread-safe transfers."""
    cfg = api.nixl_agent_config(backends=list(plugins),
                                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    try:
        with _AGENT_LOCK:
            real = api.nixlBind
            api.nixlBind = _BindingsShim(real, PROGRESS_DELAY_US)
            try:
                agent = api.nixl_agent(name, cfg)
            finally:
                api.nixlBind = real
    except Exception as e:  # NIXL's errors are plain Exception subclasses
        raise TransferError(f"NIXL agent {name} could not start with plugins {list(plugins)}: "
                            f"{type(e).__name__}: {e}") from None
    missing = [p for p in plugins if p not in agent.backends]
    if missing:
        raise TransferError(f"NIXL agent {name}: plugin(s) {missing} did not load "
                            f"(available: {agent.get_plugin_list()})")
    return agent
