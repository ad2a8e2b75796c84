"""`python -m pdserve.router ...`: the router without the pdserve CLI wrapper."""

from . import build_router_parser, run_router

if __name__ == "__main__":
    run_router(build_router_parser().parse_args())
