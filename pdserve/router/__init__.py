"""PD router: fronts prefill and decode servers like sglang-router's PD mode (same flags, same wire).

Entry points for the CLI: `build_router_parser()` and `run_router(args)`. No torch anywhere here.
"""

from .cli_args import build_router_parser, config_from_args
from .config import RouterConfig, ServerSpec

__all__ = ["build_router_parser", "config_from_args", "run_router", "RouterConfig", "ServerSpec"]


def run_router(args) -> None:
    """Run the router described by flags from build_router_parser() until SIGINT/SIGTERM."""
    from .app import run_router as _run

    _run(args)
