"""Fused bfloat16 elementwise ops for CPUs with AVX-512 BF16 or AVX2 (engine/cpu_fused_ops.c), bound
with ctypes: rms_norm, residual add + rms_norm and RoPE, each one C call in
place of a chain of small torch ops, rounding where and as the torch formulas in model.py do.

Built with gcc at first use and cached like the paged attention kernel (cpu_kernels); where the
CPU or compiler lacks what it needs, `load_fused_ops` returns None and callers keep the torch
formulas. Load after torch, so the kernels' OpenMP runs on torch's libgomp thread pool.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_kernels
from .cpu_kernels import AVX2_CPU, AVX2_FLAGS, AVX512_BF16_CPU, build_for, build_for_avx512_bf16

FUSED_OPS_SRC = Path(__file__).with_name("cpu_fused_ops.c")


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride of a 2-D bf16 CPU tensor whose rows are contiguous."""
    if t.dim() != 2 or t.dtype is not torch.bfloat16 or t.device.type != "cpu":
        raise ValueError(f"{name}: need a 2-D bfloat16 CPU tensor, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: rows must be contiguous (stride {t.stride()})")
    return t.stride(0)


class FusedOps:
    """The ops, each a drop-in for the torch formula named in its docstring (bf16 CPU tensors,
    2-D [T, N], rows contiguous, row stride free)."""

    def __init__(self, lib: Path):
        so = ctypes.CDLL(str(lib))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._rms = so.pd_rms_norm
        self._rms.argtypes = [p, i64, p, p, i64, i64, f32, i32]
        self._add_rms = so.pd_add_rms_norm
        self._add_rms.argtypes = [p, i64, p, i64, p, p, i64, i64, f32, i32]
        self._rope = so.pd_rope
        self._rope.argtypes = [p, i64, p, i64, p, i64, p, i64, i64, i64, i32]
        for fn in (self._rms, self._add_rms, self._rope):
            fn.restype = i32
        self.path = lib

    @staticmethod
    def supports(dtype: torch.dtype, device) -> bool:
        """Whether the ops handle a model in this dtype on this device (else use torch)."""
        return dtype is torch.bfloat16 and torch.device(device).type == "cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """model.rms_norm(x, weight, eps) -> new contiguous [T, N]."""
        T, N = x.shape
        xs = _rows(x, "x")
        assert weight.is_contiguous() and weight.numel() == N and weight.dtype is torch.bfloat16
        out = torch.empty(T, N, dtype=torch.bfloat16)
        rc = self._rms(x.data_ptr(), xs, weight.data_ptr(), out.data_ptr(), T, N, eps,
                       torch.get_num_threads())
        if rc:
            raise RuntimeError(f"pd_rms_norm failed (rc {rc}) for T={T} N={N}")
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x.add_(delta); return model.rms_norm(x, weight, eps) (x updated in place)."""
        T, N = x.shape
        assert delta.shape == x.shape, (delta.shape, x.shape)
        xs, ds = _rows(x, "x"), _rows(delta, "delta")
        assert weight.is_contiguous() and weight.numel() == N and weight.dtype is torch.bfloat16
        out = torch.empty(T, N, dtype=torch.bfloat16)
        rc = self._add_rms(x.data_ptr(), xs, delta.data_ptr(), ds, weight.data_ptr(),
                           out.data_ptr(), T, N, eps, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"pd_add_rms_norm failed (rc {rc}) for T={T} N={N}")
        return out

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """model.apply_rope(qk, cos, sin) for qk [T, H, D] (heads contiguous within a row, row
        stride free) and cos/sin [T, D/2] or [T, 1, D/2] -> new contiguous [T, H, D]."""
        T, H, D = qk.shape
        if qk.dtype is not torch.bfloat16 or qk.device.type != "cpu":
            raise ValueError(f"qk: need bfloat16 on CPU, got {qk.dtype} on {qk.device}")
        if qk.stride(2) != 1 or (H > 1 and qk.stride(1) != D):
            raise ValueError(f"qk: heads must be contiguous within a row (stride {qk.stride()})")
        cs = []
        for name, t in (("cos", cos), ("sin", sin)):
            t2 = t.reshape(t.shape[0], t.shape[-1]) if t.dim() == 3 else t
            if t2.shape != (T, D // 2):
                raise ValueError(f"{name}: need [T, D/2] = [{T}, {D // 2}], got {tuple(t.shape)}")
            cs.append((t2, _rows(t2, name)))
        (c, c_s), (s, s_s) = cs
        out = torch.empty(T, H, D, dtype=torch.bfloat16)
        rc = self._rope(qk.data_ptr(), qk.stride(0), c.data_ptr(), c_s, s.data_ptr(), s_s,
                        out.data_ptr(), T, H, D, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"pd_rope failed (rc {rc}) for T={T} H={H} D={D}")
        return out


@functools.cache
def load_fused_ops(cache_dir: str) -> FusedOps | None:
    """The fused ops, built into cache_dir/kernels if needed; None (reason logged) where they
    cannot be built here. Once per process."""
    # -ffp-contract=off: no fused multiply-adds where torch rounds after the multiply
    if AVX512_BF16_CPU <= cpu_kernels.cpu_flags():  # (looked up there: tests patch it)
        lib = build_for_avx512_bf16("fused ops", FUSED_OPS_SRC, cache_dir, ("-ffp-contract=off",))
    else:
        lib = build_for("fused ops (AVX2)", FUSED_OPS_SRC, cache_dir, AVX2_CPU, AVX2_FLAGS + ("-ffp-contract=off",))
    return None if lib is None else FusedOps(lib)
