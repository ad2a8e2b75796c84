"""Builds a worker's engine from the server config: dtype, threads, model, KV pool size."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..core.config import ServerConfig
from ..core.cpu_binding import rank_cpus, threads_for
from ..core.pd_vocab import KvDtype
from ..engine.calibration import Forced, PlanCache, plan_for
from ..engine.cpu_fused import load_fused_ops
from ..engine.cpu_kernels import PagedAttentionKernel, load_paged_attention
from ..engine.cpu_matmul import MatmulKernels, load_gemv, load_matmul
from ..engine.cpu_plan import AttentionPath, ElementwisePath
from ..engine.engine import Engine, EngineConfig
from ..engine.kv_pool import KVPool
from ..engine.linear import MatmulPath
from ..engine.loader import load_model
from ..engine.spin_governor import SpinGovernor, governor_for
from ..grammar.matcher import Matchers
from ..model_files.resolve import cache_root

log = logging.getLogger(__name__)

DTYPES = {KvDtype.BFLOAT16: torch.bfloat16, KvDtype.FLOAT32: torch.float32, KvDtype.FLOAT16: torch.float16}


def pick_dtype(name: str, device: str, checkpoint: str | None = None) -> torch.dtype:
    """--dtype, or for auto the checkpoint's torch_dtype where it is bfloat16 or float16; a
    float32 (or unstated) checkpoint is served in bfloat16 where this device has it, as vLLM
    and SGLang serve float32 checkpoints in half precision (--dtype float32 keeps float32)."""
    if name != "auto":
        return DTYPES[KvDtype.parse(name)]
    half_ok = device == "cuda" or torch.backends.mkldnn.is_available()
    if checkpoint == "float16":
        return torch.float16
    if checkpoint == "bfloat16" and device == "cpu" and not half_ok:
        return torch.float32
    return torch.bfloat16 if half_ok else torch.float32


def pick_threads(cfg: ServerConfig, dp_rank: int = 0) -> int:
    return threads_for(cfg.num_threads, rank_cpus(cfg.cpu_bind, dp_rank, cfg.dp_size), cfg.dp_size)


def spin_governor(cfg: ServerConfig, dp_rank: int = 0) -> SpinGovernor | None:
    """The worker's spin governor where its waits spin on a team as large as its cores (CPU only)."""
    if cfg.device != "cpu":
        return None
    return governor_for(pick_threads(cfg, dp_rank))


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def num_kv_pages(cfg: ServerConfig, bytes_per_page: int, device: str) -> int:
    if cfg.max_total_tokens > 0:
        return max(1, -(-cfg.max_total_tokens // cfg.page_size))
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
    else:
        free = available_memory_bytes()
    return max(16, int(free * cfg.mem_fraction) // bytes_per_page)


def kernel_cache(cfg: ServerConfig, dtype: torch.dtype, cache_dir: str) -> str | None:
    """Where our C kernels are built, or None where they are not wanted: they apply on CPU in
    bfloat16 unless --cpu-kernels torch."""
    if cfg.cpu_kernels != "auto" or cfg.device != "cpu" or dtype is not torch.bfloat16:
        return None
    return cache_root(cache_dir)


def matmul_kernels(cfg: ServerConfig, dtype: torch.dtype, cache_dir: str, weight_bytes: int) -> MatmulKernels:
    """Our bf16 matmul kernels where wanted and they build here. The few-row kernel keeps a second
    copy of the weights beside oneDNN's, so it is left out where that copy would take more than
    a quarter of the memory still free."""
    where = kernel_cache(cfg, dtype, cache_dir)
    if where is None:
        return MatmulKernels()
    gemv = load_gemv(where)
    if gemv is not None and weight_bytes > available_memory_bytes() // 4:
        log.info("few-row matmul kernel not used: a second copy of the %.1f GiB of weights would take "
                 "more than a quarter of the free memory", weight_bytes / 2**30)
        gemv = None
    return MatmulKernels(load_matmul(where), gemv)


def forced_choices(cfg: ServerConfig) -> Forced:
    """The --cpu-* flags that fix a choice (auto: measured)."""
    def val(enum_cls, v: str):
        return None if v == "auto" else enum_cls(v)
    return Forced(val(MatmulPath, cfg.cpu_matmul), val(AttentionPath, cfg.cpu_decode_attention),
                  val(AttentionPath, cfg.cpu_prefill_attention), val(ElementwisePath, cfg.cpu_norms))


def attention_kernel(cfg: ServerConfig, dtype: torch.dtype,
                     cache_dir: str) -> PagedAttentionKernel | None:
    """Our CPU paged-attention kernel where wanted and it builds here; None: the torch path."""
    where = kernel_cache(cfg, dtype, cache_dir)
    return None if where is None else load_paged_attention(where)


def fused_ops(cfg: ServerConfig, dtype: torch.dtype, cache_dir: str):
    """Our fused norm/RoPE ops (cpu_fused.FusedOps) where wanted and they build; else None."""
    where = kernel_cache(cfg, dtype, cache_dir)
    return None if where is None else load_fused_ops(where)


def apply_cpu_plan(cfg: ServerConfig, model, cache_dir: str, mode: str | None = None):
    """The CPU plan for a freshly loaded model (calibration.plan_for: measured, cached, or
    forced by the --cpu-* flags; mode overrides --cpu-calibration), applied to its matmuls and
    norms -> (plan, the attention kernel the engine gets or None)."""
    dtype, mcfg = model.dtype, model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kernel, kernels, fused = (attention_kernel(cfg, dtype, cache_dir),
                              matmul_kernels(cfg, dtype, cache_dir, weight_bytes), fused_ops(cfg, dtype, cache_dir))
    if kernel is not None and not kernel.supports_model(dtype, mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim):
        kernel = None  # e.g. head_dim 80: the torch path
    plan = plan_for(model, cfg.device, kernel, kernels, fused, forced_choices(cfg), mode or cfg.cpu_calibration,
                    PlanCache(Path(cache_root(cache_dir)) / "calibration"), torch.get_num_threads())
    model.use_matmul(plan.matmul, kernels)
    model.use_fused_ops(fused if plan.elementwise is ElementwisePath.FUSED else None)
    return plan, kernel


def build_engine(cfg: ServerConfig, model_dir: str, cache_dir: str = "", dp_rank: int = 0,
                 allow_long_context: bool = False):
    """-> (engine, model_config, dtype); cache_dir: where built kernels are kept (as for models);
    allow_long_context: --context-length may exceed the model's (Envs.allow_long_context)."""
    torch.set_num_threads(pick_threads(cfg, dp_rank))
    device = cfg.device
    from ..model_files.hf_config import ModelConfig, context_limit

    mcfg = ModelConfig.from_dir(model_dir)
    dtype = pick_dtype(cfg.dtype, device, mcfg.torch_dtype)
    max_context = context_limit(mcfg, cfg.context_length, allow_long_context)
    model, mcfg = load_model(model_dir, dtype, device, max_positions=max_context, matmul=MatmulPath.TORCH)
    plan, kernel = apply_cpu_plan(cfg, model, cache_dir)
    per_page = KVPool.bytes_per_page(mcfg.num_layers, cfg.page_size, mcfg.num_kv_heads,
                                     mcfg.head_dim, dtype)
    pages = num_kv_pages(cfg, per_page, device)
    pool = KVPool(mcfg.num_layers, pages, cfg.page_size, mcfg.num_kv_heads, mcfg.head_dim,
                  dtype, device)
    ecfg = EngineConfig(
        num_pages=pages,
        page_size=cfg.page_size,
        max_running=cfg.max_running_requests,
        prefill_budget=cfg.chunked_prefill_size,
        max_batched_tokens=cfg.max_num_batched_tokens,
        max_context=max_context,
        eos_token_ids=tuple(mcfg.eos_token_ids),
        vocab_size=mcfg.vocab_size,
        # longrope / dynamic NTK: a page's keys depend on its sequence's length, not shareable
        prefix_cache=not cfg.disable_prefix_cache and not model.rope_depends_on_length,
    )
    engine = Engine(model, pool, ecfg, device, kernel,
                    grammar_matchers(model_dir, mcfg.vocab_size, ecfg.eos_token_ids, torch.get_num_threads()),
                    plan=plan)
    return engine, mcfg, dtype


def grammar_matchers(model_dir: str, vocab_size: int, eos: tuple[int, ...], threads: int) -> Matchers | None:
    """Structured outputs over the model's tokenizer.json (built on the first grammar request);
    None where the directory has none (such a request is then a 400)."""
    path = os.path.join(model_dir, "tokenizer.json")
    return Matchers(path, vocab_size, eos, threads) if os.path.isfile(path) else None
