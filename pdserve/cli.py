"""The `pdserve` command: serve, router, up, bench. Imports each subcommand lazily so that
the router and the server fronts never load torch."""

from __future__ import annotations

import argparse
import sys


def _serve(argv: list[str]) -> None:
    from .core.config import ServerConfig, add_dataclass_args, dataclass_from_args

    p = argparse.ArgumentParser(prog="pdserve serve", description="run a colocated, prefill or decode server")
    add_dataclass_args(p, ServerConfig)
    args = p.parse_args(argv)
    try:
        cfg = dataclass_from_args(ServerConfig, args)
    except ValueError as e:
        p.error(str(e))
    from .core.envs import Envs
    from .model_files.resolve import ModelNotFound, resolve_model

    try:
        model_dir = resolve_model(cfg.model, Envs.read().cache_dir)
    except ModelNotFound as e:
        sys.exit(f"pdserve: {e}")
    from .server.launch import run_server

    run_server(cfg, model_dir)


def _router(argv: list[str]) -> None:
    from .router.app import run_router
    from .router.cli_args import build_router_parser

    run_router(build_router_parser().parse_args(argv))


def _up(argv: list[str]) -> None:
    from .up import main as up_main

    up_main(argv)


BENCHES = {
    "engine": "pdserve.bench.engine_bench",
    "serve": "pdserve.bench.serve",
    "transfer": "pdserve.bench.transfer_bench",
    "router": "pdserve.bench.router_bench",
    "pd": "pdserve.bench.pd_bench",
    "sweep": "pdserve.bench.sweep",
    "metrics": "pdserve.bench.metrics_overhead",
    "kv": "pdserve.bench.kv_backends_bench",
    "kv-remote": "pdserve.bench.kv_remote_bench",
    "kernels": "pdserve.bench.kernels_bench",
    "cache-parity": "pdserve.bench.cache_parity",
    "long-arrival": "pdserve.bench.long_arrival",
    "pd-reuse": "pdserve.bench.pd_reuse_bench",
    "chaos": "pdserve.bench.chaos",
    "structured": "pdserve.bench.structured_bench",
    "calibrate": "pdserve.bench.calibrate",
    "up": "pdserve.bench.up_bench",
    "rounds": "pdserve.bench.rounds",
}


def _bench(argv: list[str]) -> None:
    if not argv or argv[0] not in BENCHES:
        sys.exit(f"usage: pdserve bench {{{','.join(BENCHES)}}} [options]")
    import importlib

    rc = importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
    sys.exit(rc or 0)


COMMANDS = {"serve": _serve, "router": _router, "up": _up, "bench": _bench}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: pdserve {serve,router,up,bench} [options]\n"
              "  serve   run a colocated, prefill or decode server\n"
              "  router  run the PD router (sglang-router's flags)\n"
              "  up      router + prefill + decode on this machine with the default model\n"
              "  bench   benchmarks: " + ", ".join(BENCHES), file=sys.stderr)
        sys.exit(2)
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
