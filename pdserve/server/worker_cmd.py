"""How a front starts one DP worker process: the command line and the config it passes."""

from __future__ import annotations

import sys
from typing import Mapping

from ..core.config import ServerConfig, config_to_json
from ..core.cpu_binding import omp_env

DEFAULT_WORKER_MODULE = "pdserve.worker"


def worker_command(worker_module: str, dp_rank: int, cfg: ServerConfig, model_dir: str,
                   in_addr: str, out_addr: str) -> list[str]:
    return [sys.executable, "-m", worker_module, "--dp-rank", str(dp_rank),
            "--config-json", config_to_json(cfg), "--model-dir", model_dir,
            "--in-addr", in_addr, "--out-addr", out_addr]


def worker_env(cfg: ServerConfig, dp_rank: int, current: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP placement of one worker (core/cpu_binding.py), read when torch starts in it."""
    return omp_env(current)
