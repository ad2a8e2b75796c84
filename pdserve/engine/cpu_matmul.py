"""Our bfloat16 weight matmuls, bound with ctypes: for CPUs with AVX2 and FMA
(engine/cpu_matmul.c: the weight packed once into 16-column panels, float32 sums, the output
rounded once), and for decode's one or two rows on CPUs with AVX-512 BF16 (engine/cpu_gemv.c,
on the weight as stored).

Where torch has no fast bfloat16 matmul (oneDNN's needs AVX-512) this is the difference between
a usable and an unusable bf16 server: on a 2-core AMD EPYC (Zen 1, AVX2) SmolLM2's gate/up
matmul takes 0.10 ms at one row against 8 ms for torch's bf16 F.linear and 0.7 ms for float32
MKL (docs/benchmarks.md, "AMD EPYC Zen 1"). Built with gcc at first use and cached like the
other kernels (cpu_kernels.build_for); `load_matmul` gives None where the CPU or compiler lacks
what it needs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu_kernels import AVX2_CPU, AVX2_FLAGS, build_for, build_for_avx512_bf16

MATMUL_SRC = Path(__file__).with_name("cpu_matmul.c")
GEMV_SRC = Path(__file__).with_name("cpu_gemv.c")
PANEL = 16  # output columns per packed panel
GEMV_ROWS = 2  # the most rows cpu_gemv.c is used for (it takes 4; at 4 oneDNN was faster)


class PanelMatmul:
    """The library: pack a [N, K] bf16 weight, then y = x @ W.T + b on the packed form."""

    def __init__(self, lib: Path):
        so = ctypes.CDLL(str(lib))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._pack = so.pd_pack_bf16
        self._pack.argtypes = [p, i64, i64, i64, p]
        self._linear = so.pd_linear_bf16
        self._linear.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, i32]
        for fn in (self._pack, self._linear):
            fn.restype = i32
        self.path = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 (rows contiguous) -> the packed panels, a flat bf16 tensor."""
        N, K = weight.shape
        if weight.dtype is not torch.bfloat16 or weight.stride(1) != 1:
            raise ValueError(f"weight: need bf16 with contiguous rows, got {weight.dtype} {weight.stride()}")
        out = torch.empty(-(-N // PANEL) * PANEL * K, dtype=torch.bfloat16)
        rc = self._pack(weight.data_ptr(), N, K, weight.stride(0), out.data_ptr())
        if rc:
            raise RuntimeError(f"pd_pack_bf16 failed (rc {rc}) for N={N} K={K}")
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous, row stride free) -> [M, n] bf16."""
        if x.dtype is not torch.bfloat16 or x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1):
            raise ValueError(f"x: need 2-D bf16 with contiguous rows, got {x.dtype} "
                             f"{tuple(x.shape)} {x.stride()}")
        M, K = x.shape
        y = torch.empty(M, n, dtype=torch.bfloat16)
        rc = self._linear(x.data_ptr(), M, max(x.stride(0), K), packed.data_ptr(), n, K,
                          None if bias is None else bias.data_ptr(), y.data_ptr(), n,
                          torch.get_num_threads())
        if rc:
            raise RuntimeError(f"pd_linear_bf16 failed (rc {rc}) for M={M} N={n} K={K}")
        return y


@functools.cache
def load_matmul(cache_dir: str) -> PanelMatmul | None:
    """The panel matmul, built into cache_dir/kernels if needed; None (reason logged) where it
    cannot be built here. Once per process."""
    lib = build_for("panel matmul", MATMUL_SRC, cache_dir, AVX2_CPU, AVX2_FLAGS)
    return None if lib is None else PanelMatmul(lib)


class GemvMatmul:
    """The library of cpu_gemv.c: y = x @ W.T + b for x of 1 to GEMV_ROWS rows, W [N, K] bf16 as stored."""

    def __init__(self, lib: Path):
        so = ctypes.CDLL(str(lib))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._gemv = so.pd_gemv_bf16
        self._gemv.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, i64, i32]
        self._gemv.restype = i32
        self.path = lib

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M <= GEMV_ROWS, K] bf16 with contiguous rows, weight [N, K] bf16 with contiguous rows."""
        M, K = x.shape
        N = weight.shape[0]
        y = torch.empty(M, N, dtype=torch.bfloat16)
        rc = self._gemv(x.data_ptr(), M, max(x.stride(0), K), weight.data_ptr(), N, K, weight.stride(0),
                        None if bias is None else bias.data_ptr(), y.data_ptr(), N, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"pd_gemv_bf16 failed (rc {rc}) for M={M} N={N} K={K}")
        return y


@functools.cache
def load_gemv(cache_dir: str) -> GemvMatmul | None:
    """The few-row kernel, built into cache_dir/kernels if needed; None (reason logged) where the
    CPU lacks AVX-512 BF16 or there is no compiler. Once per process."""
    lib = build_for_avx512_bf16("few-row matmul", GEMV_SRC, cache_dir)
    return None if lib is None else GemvMatmul(lib)


@dataclass(frozen=True)
class MatmulKernels:
    """Our matmul kernels that were built here (None: not on this CPU, or not wanted)."""

    panel: PanelMatmul | None = None
    gemv: GemvMatmul | None = None
