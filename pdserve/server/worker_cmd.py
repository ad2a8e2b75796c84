"""How a front starts one DP worker process: the command line and the config it passes."""

from __future__ import annotations

import enum
import json
import sys
from dataclasses import asdict

from ..core.config import ServerConfig

DEFAULT_WORKER_MODULE = "pdserve.worker"


def config_to_json(cfg: ServerConfig) -> str:
    """ServerConfig as JSON (enums by value); the worker rebuilds it with ServerConfig(**d)."""
    return json.dumps({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(cfg).items()})


def worker_command(worker_module: str, dp_rank: int, cfg: ServerConfig, model_dir: str,
                   in_addr: str, out_addr: str) -> list[str]:
    return [sys.executable, "-m", worker_module, "--dp-rank", str(dp_rank),
            "--config-json", config_to_json(cfg), "--model-dir", model_dir,
            "--in-addr", in_addr, "--out-addr", out_addr]
