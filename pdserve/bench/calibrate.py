"""`pdserve bench calibrate`: what a worker measures on this CPU at first start, what it chose
and why (the wait setting of its OpenMP threads, then its matmul, attention and norm paths).

Measures again by default (`--mode redo`, and the result replaces the cached one that servers
read); `--mode auto` shows the cached plan if there is one. The engine's part runs in a child
process started with the chosen wait setting, as a worker is. Same flags as `pdserve serve`
for the model, dtype, threads, cores and the `--cpu-*` choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from ..core.config import ServerConfig, add_dataclass_args, config_from_json, config_to_json, dataclass_from_args
from ..core.host import HostInfo


def _print_plan(plan: dict) -> None:
    rows = [("matmul", plan["matmul"]), ("decode attention", plan["decode_attention"])]
    lo = 0
    for limit, path in zip(plan["prefill_buckets"], plan["prefill_attention"]):
        rows.append((f"prefill attention, KV {lo + 1}-{limit}" if limit != plan["prefill_buckets"][-1]
                     else f"prefill attention, KV > {lo}", path))
        lo = limit
    rows.append(("norms and RoPE", plan["elementwise"]))
    for what, path in rows:
        print(f"  {what:<34} {path}")
    print("why:")
    for k, why in plan["reasons"].items():
        print(f"  {k}: {why}")


def _engine_part(cfg: ServerConfig, model_dir: str, mode: str) -> None:
    """In the child: load the model, measure (or read) its plan, print it as JSON."""
    import torch

    from ..core.cpu_binding import rank_cpus, set_process_cpus
    from ..core.envs import Envs
    from ..engine.linear import MatmulPath
    from ..engine.loader import load_model
    from ..model_files.hf_config import ModelConfig
    from ..worker.setup import apply_cpu_plan, pick_dtype, pick_threads

    set_process_cpus(rank_cpus(cfg.cpu_bind, 0, cfg.dp_size))
    torch.set_num_threads(pick_threads(cfg, 0))
    dtype = pick_dtype(cfg.dtype, cfg.device, ModelConfig.from_dir(model_dir).torch_dtype)
    model, _ = load_model(model_dir, dtype, cfg.device, matmul=MatmulPath.TORCH)
    plan, _ = apply_cpu_plan(cfg, model, Envs.read().cache_dir, mode)
    print("PLAN " + json.dumps({"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                                **plan.to_json()}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench calibrate", description=__doc__.splitlines()[0])
    add_dataclass_args(p, ServerConfig)
    p.add_argument("--mode", default="redo", choices=["redo", "auto"],
                   help="redo: measure again and replace the cached result; auto: the cached one if any")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model

    if a.child:
        _engine_part(config_from_json(a.child), resolve_model(a.model, Envs.read().cache_dir), a.mode)
        return 0
    cfg = dataclass_from_args(ServerConfig, a)
    model_dir = resolve_model(cfg.model, Envs.read().cache_dir)
    host = HostInfo.read()
    print(f"host: {host.model_name}; {host.cores} cores; ISA {' '.join(sorted(host.isa_flags)) or '?'}; "
          f"AMX {'yes' if host.summary()['amx'] else 'no'}; AVX-512 BF16 "
          f"{'yes' if 'avx512_bf16' in host.isa_flags else 'no'}")
    from ..server.worker_cmd import wait_choice

    wait = wait_choice(cfg, os.environ, redo=a.mode == "redo")
    print(f"OpenMP waits: {wait.policy} {wait.env or ''}\n  why: {wait.reason}")
    child_cfg = dataclasses.replace(cfg, cpu_wait_policy="auto")
    env = {**{k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
           **wait.env}
    done = subprocess.run([sys.executable, "-m", "pdserve.bench.calibrate", "--model", cfg.model,
                           "--mode", a.mode, "--child", config_to_json(child_cfg)],
                          env=env, capture_output=True, text=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PLAN ")), None)
    if done.returncode != 0 or line is None:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    plan = json.loads(line[5:])
    print(f"engine plan ({plan['dtype']}, {plan['threads']} threads, model {model_dir}):")
    _print_plan(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
