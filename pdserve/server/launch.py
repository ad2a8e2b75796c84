"""Start a server front: `run_server` (blocking, uvicorn on cfg.host:cfg.port) and
`create_app` (the ASGI app, for tests and embedding). Also `python -m pdserve.server.launch`.

Shutdown: uvicorn turns SIGTERM/SIGINT into the app's lifespan shutdown, which stops the
workers (ShutdownReq, wait, kill by pid); a shutdown request during start-up interrupts the
wait for the workers; an atexit hook kills any worker still alive. A front that dies without any
of that (SIGKILL, OOM) takes its workers along: the pool spawns them from this main thread's
event loop with a parent-death signal (core/child_process.py).
"""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
from dataclasses import replace

import uvicorn
from fastapi import FastAPI

from ..core.config import ServerConfig, add_dataclass_args, dataclass_from_args
from ..core.log_format import LogContext, configure_logging, new_instance_id
from ..core.netaddr import AddressError
from .app import build_app
from .front import Front
from .roles import FrontRole
from .worker_cmd import DEFAULT_WORKER_MODULE

STARTUP_FAILURE = 3


def create_app(cfg: ServerConfig, model_dir: str, worker_module: str = DEFAULT_WORKER_MODULE,
               role: FrontRole | None = None, start_timeout_s: float = 600.0,
               should_abort=None) -> FastAPI:
    """The app; its lifespan starts the workers and stops them (app.state.front is the Front)."""
    front = Front(cfg, model_dir, worker_module, role, start_timeout_s)
    return build_app(front, should_abort)


def run_server(cfg: ServerConfig, model_dir: str, worker_module: str = DEFAULT_WORKER_MODULE,
               start_timeout_s: float = 600.0) -> None:
    """Serve until SIGTERM/SIGINT; exits with status 3 if the workers fail to start."""
    cfg = replace(cfg, instance_id=cfg.instance_id or new_instance_id())  # the workers log it too
    configure_logging(cfg.log_level, cfg.log_format, LogContext(cfg.role.value, cfg.instance_id))
    server: uvicorn.Server | None = None
    try:
        app = create_app(cfg, model_dir, worker_module, start_timeout_s=start_timeout_s,
                         should_abort=lambda: server is not None and server.should_exit)
    except (AddressError, ValueError) as e:  # also a bad API option (server/api_options.py)
        print(f"pdserve: {e}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    front: Front = app.state.front
    atexit.register(front.pool.kill_all)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, log_config=None,
                            lifespan="on", timeout_keep_alive=75, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT itself, then re-raises them into the handlers it found:
    # make those no-ops so that a graceful shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    front.pool.kill_all()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.server.launch",
                                description="run a server front over a local model directory")
    add_dataclass_args(p, ServerConfig)
    p.add_argument("--model-dir", required=True, help="local model directory (tokenizer.json, weights)")
    p.add_argument("--worker-module", default=DEFAULT_WORKER_MODULE, help="python module of the DP workers")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    args = p.parse_args(argv)
    cfg = dataclass_from_args(ServerConfig, args)
    run_server(cfg, args.model_dir, args.worker_module, args.start_timeout)


if __name__ == "__main__":
    main()
