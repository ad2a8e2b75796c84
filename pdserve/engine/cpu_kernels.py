"""Our C kernels for CPUs: compiled with gcc at first use, cached by source hash, loaded by ctypes.

Only where the CPU has what a kernel's source needs (read from /proc/cpuinfo) and a C compiler
is on PATH; otherwise `load_paged_attention` returns None with the reason logged and the
engine keeps its torch path. Load after torch: the kernels' OpenMP calls then run on torch's
own libgomp thread pool rather than a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..core.host import cpu_flags  # noqa: F401  (here so tests can patch it per module)

log = logging.getLogger(__name__)

PAGED_ATTENTION_SRC = Path(__file__).with_name("cpu_paged_attention.c")
PAGED_ATTENTION_AVX2_SRC = Path(__file__).with_name("cpu_attention_avx2.c")
AVX512_BF16_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")
AVX512_BF16_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma"})
AVX2_FLAGS = ("-mavx2", "-mfma")
AVX2_CPU = frozenset({"avx2", "fma"})
COMPILE_TIMEOUT_S = 120.0


def compile_cached(src: Path, flags: tuple[str, ...], cache_dir: Path, cc: str = "gcc") -> Path:
    """The shared library built from src with flags, compiling only if this exact source, flag set
    and compiler have not been built into cache_dir before. Safe when processes race: each
    compiles to its own temporary file and renames it into place."""
    code = src.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=COMPILE_TIMEOUT_S).stdout.splitlines()[:1]
    key = hashlib.sha256(code + repr((flags, version)).encode()).hexdigest()[:16]
    out = cache_dir / f"{src.stem}-{key}.so"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        cmd = [cc, "-O3", "-fPIC", "-shared", "-fopenmp", *flags, "-o", tmp, str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


TILE_TWO_PASS = 1  # PagedAttentionKernel.tile_flags: two-pass softmax
TILE_FORCE = 8  # tile_flags: tile every run of tile_min queries (no cost model)
PER_QUERY_ONLY = 1 << 30  # a tile_min no run reaches: every query on the per-query path


class PagedAttentionKernel:
    """One layer of a step over the paged pool (see cpu_paged_attention.c): decode stores each
    sequence's new K/V at its slot, then attends; prefill attends causally after the caller
    stored the new K/V. bfloat16 everywhere."""

    # Prefill: a sequence's chunk is attended in tiles (blocks of 48 / G query tokens with the
    # G query heads of a KV head x blocks of 64 keys, each K/V row loaded once per block) where
    # the kernel's cost model says that is faster (from 3-8 tokens after a long prefix, ~24-32
    # with none; tile_run_here in the C source); decode rows and short chunks one query at a
    # time. Chunks under tile_min tokens never tile (0: the kernel's default, 2;
    # PER_QUERY_ONLY: never).
    tile_min: int = 0
    # TILE_TWO_PASS (the default): HF's rounding points, probabilities normalised before they
    # round to bf16, as the per-query path and HF's eager attention; 0: online softmax, ~1.5x
    # faster but it rounds before normalising, which flipped a greedy answer of the default
    # model in bf16 (tests/e2e/test_up.py); TILE_FORCE: no cost model; bits 1-2: rows per block in
    # units of 48, minus one
    tile_flags: int = TILE_TWO_PASS
    isa: str = "avx512_bf16"  # the build: "avx512_bf16" (tiles long chunks) or "avx2" (never tiles)

    def __init__(self, lib: Path):
        fn = ctypes.CDLL(str(lib)).pd_paged_attention_ex
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, i64, p, i64, p, p, p, p, i64, p, p, p, i64, i32, i32, i32,
                       ctypes.c_float, i32, i32, i32]
        fn.restype = i32
        self._fn = fn
        self.path = lib

    @staticmethod
    def supports_model(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel handles a model of this dtype and attention shape."""
        return (dtype is torch.bfloat16 and head_dim in (32, 64, 128)
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16)

    @classmethod
    def supports(cls, q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        """Whether this call is one the kernel handles (else use the torch path)."""
        return (q.device.type == "cpu" and k_pool.dtype is q.dtype
                and cls.supports_model(q.dtype, q.shape[1], k_pool.shape[1], q.shape[2]))

    def __call__(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, write_slots: torch.Tensor | None,
                 table: torch.Tensor, seq_lens: torch.Tensor,
                 table_rows: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """q [B, Hq, D]; k_new, v_new [B, Hkv, D] (rows may be strided, heads contiguous);
        k_pool, v_pool [slots, Hkv, D] contiguous; write_slots [B] (None: already stored),
        table [rows, L], seq_lens [B] (keys each query reads) and table_rows [B] (its table
        row; None: row b) int64 -> [B, Hq*D]. With write_slots None, consecutive queries on
        one table row (a sequence's prefill chunk, as AttnBatch.build lays them out) are
        attended in tiles where that is faster (see tile_min). scale: of the scores (None: D ** -0.5)."""
        B, Hq, D = q.shape
        Hkv = k_new.shape[1]
        for t in (q, k_new, v_new):
            assert t.stride(2) == 1 and t.stride(1) == D, "heads must be contiguous within a row"
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and table.stride(1) == 1
        out = torch.empty(B, Hq * D, dtype=q.dtype)
        rc = self._fn(q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0),
                      v_new.data_ptr(), v_new.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                      None if write_slots is None else write_slots.data_ptr(),
                      table.data_ptr(), table.stride(0),
                      None if table_rows is None else table_rows.data_ptr(), seq_lens.data_ptr(),
                      out.data_ptr(), B, Hq, Hkv, D, D ** -0.5 if scale is None else scale,
                      torch.get_num_threads(),
                      self.tile_min, self.tile_flags)
        if rc != 0:
            raise RuntimeError(f"paged attention kernel failed (rc {rc}) for B={B} Hq={Hq} "
                               f"Hkv={Hkv} D={D}")
        return out


def build_for(what: str, src: Path, cache_dir: str, cpu_needs: frozenset[str],
              flags: tuple[str, ...]) -> Path | None:
    """src built with flags into cache_dir/kernels; None (reason logged, naming `what`) where
    this CPU lacks a flag of cpu_needs, there is no C compiler, or the build fails."""
    missing = cpu_needs - cpu_flags()
    if missing:
        log.info("%s: torch path (CPU lacks %s)", what, ", ".join(sorted(missing)))
        return None
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.info("%s: torch path (no C compiler on PATH)", what)
        return None
    try:
        return compile_cached(src, flags, Path(cache_dir) / "kernels", cc)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("%s: torch path (kernel build failed: %s)", what, e)
        return None


def build_for_avx512_bf16(what: str, src: Path, cache_dir: str, extra_flags: tuple[str, ...] = ()
                          ) -> Path | None:
    """src built for AVX-512 BF16 (see build_for)."""
    return build_for(what, src, cache_dir, AVX512_BF16_CPU, AVX512_BF16_FLAGS + extra_flags)


@functools.cache
def load_paged_attention(cache_dir: str) -> PagedAttentionKernel | None:
    """The paged attention kernel, built into cache_dir/kernels if needed: the AVX-512 BF16 one
    (tiled prefill) where the CPU has it, else the AVX2 one (one query at a time); None (reason
    logged) where neither can be built here. Once per process."""
    if AVX512_BF16_CPU <= cpu_flags():
        lib = build_for_avx512_bf16("paged attention", PAGED_ATTENTION_SRC, cache_dir)
        isa = "avx512_bf16"
    else:
        lib = build_for("paged attention (AVX2)", PAGED_ATTENTION_AVX2_SRC, cache_dir, AVX2_CPU, AVX2_FLAGS)
        isa = "avx2"
    if lib is None:
        return None
    kernel = PagedAttentionKernel(lib)
    kernel.isa = isa
    return kernel
