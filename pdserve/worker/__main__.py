"""`python -m pdserve.worker ...`: one DP worker process, started by a server front."""

from __future__ import annotations

import argparse
import logging
import signal
import traceback

from ..core.config import config_from_json
from ..core.cpu_binding import rank_cpus, set_process_cpus
from ..core.envs import Envs
from ..core.log_format import LogContext, configure_logging
from ..core.messages import WorkerFailed, WorkerReady
from .pump import WorkerChannel


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.worker")
    p.add_argument("--dp-rank", type=int, required=True)
    p.add_argument("--config-json", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--in-addr", required=True)
    p.add_argument("--out-addr", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = config_from_json(args.config_json)
    configure_logging(cfg.log_level, cfg.log_format, LogContext(cfg.role.value, cfg.instance_id, args.dp_rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when we stop
    set_process_cpus(rank_cpus(cfg.cpu_bind, args.dp_rank, cfg.dp_size))  # before any thread starts
    channel = WorkerChannel(args.in_addr, args.out_addr)
    try:
        from .role import RoleContext
        from .roles import ROLES
        from .setup import build_engine, spin_governor

        envs = Envs.read()
        engine, mcfg, dtype = build_engine(cfg, args.model_dir, envs.cache_dir, args.dp_rank,
                                           envs.allow_long_context)
        role = ROLES[cfg.role](RoleContext(engine, args.dp_rank, cfg, envs, mcfg, channel.wake))
        info = role.start()
        governor = spin_governor(cfg, args.dp_rank)
    except Exception as e:  # report start-up failure to the front in one line, then exit
        logging.getLogger(__name__).error("worker start failed: %s", traceback.format_exc())
        channel.send(WorkerFailed(args.dp_rank, f"{type(e).__name__}: {e}"))
        channel.close()
        raise SystemExit(1)
    from .loop import WorkerLoop

    channel.send(WorkerReady(args.dp_rank, engine.cfg.num_pages, engine.cfg.page_size,
                             engine.cfg.max_context, {"dtype": str(dtype).removeprefix("torch."),
                                                      "vocab_size": mcfg.vocab_size,
                                                      "cpu_plan": engine.plan.to_json(), **info}))
    try:
        WorkerLoop(engine, role, channel, args.dp_rank, governor).run()
    finally:
        role.close()
        channel.close()


if __name__ == "__main__":
    main()
