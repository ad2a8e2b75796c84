"""How a front starts one DP worker process: the command line and the config it passes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

from ..core.config import ServerConfig, config_to_json
from ..core.cpu_binding import rank_cpus, threads_for
from ..core.envs import Envs
from ..core.wait_policy import WaitChoice, resolve
from ..model_files.resolve import cache_root

DEFAULT_WORKER_MODULE = "pdserve.worker"


def worker_command(worker_module: str, dp_rank: int, cfg: ServerConfig, model_dir: str,
                   in_addr: str, out_addr: str) -> list[str]:
    return [sys.executable, "-m", worker_module, "--dp-rank", str(dp_rank),
            "--config-json", config_to_json(cfg), "--model-dir", model_dir,
            "--in-addr", in_addr, "--out-addr", out_addr]


def worker_env(wait: WaitChoice, current: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment adds to ours: its OpenMP wait setting (core/wait_policy.py),
    read when torch starts in it."""
    return dict(wait.env)


def wait_choice(cfg: ServerConfig, current: Mapping[str, str], redo: bool = False) -> WaitChoice:
    """The wait setting for this server's workers (rank 0's threads and cores stand for all);
    redo: probe again (pdserve bench calibrate)."""
    cpus = rank_cpus(cfg.cpu_bind, 0, cfg.dp_size)
    threads = threads_for(cfg.num_threads, cpus, cfg.dp_size)
    cache = Path(cache_root(Envs.read().cache_dir)) / "calibration"
    return resolve(cfg.cpu_wait_policy, threads, cpus, cache, current, redo=redo)
