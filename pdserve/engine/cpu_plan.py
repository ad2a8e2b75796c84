"""What the engine runs each piece of a step on, for this CPU: the outcome of calibration.py.

A `CpuPlan` names a path for the matmuls, decode attention, prefill attention per KV-length
bucket and the norms/RoPE, with the reason for each choice. It is plain data (JSON in the
calibration cache, `server_info` under `cpu_plan`); `AttentionPaths` turns it into the kernel
objects a step's AttnBatch takes.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import asdict, dataclass, field

import torch

from .cpu_kernels import PER_QUERY_ONLY, PagedAttentionKernel
from .linear import MatmulPath


class AttentionPath(str, enum.Enum):
    KERNEL = "kernel"  # our C kernel; long chunks tiled where its cost model says so
    KERNEL_PER_QUERY = "kernel_per_query"  # our C kernel, one query at a time
    TORCH = "torch"  # torch ops in the model's dtype (attention.py's torch path)
    TORCH_FP32 = "torch_fp32"  # the same ops on float32 copies (CPUs with no fast bf16 matmul)


KERNEL_ATTENTION = (AttentionPath.KERNEL, AttentionPath.KERNEL_PER_QUERY)


class ElementwisePath(str, enum.Enum):
    FUSED = "fused"  # our C rms_norm / add + rms_norm / RoPE (bit-identical to torch's)
    TORCH = "torch"


# Prefill attention buckets: the longest KV of a step's prefilling sequences, up to this many
# tokens (the last bucket takes every longer one).
PREFILL_BUCKETS = (512, 2048, 8192)


@dataclass(frozen=True)
class CpuPlan:
    matmul: MatmulPath
    decode_attention: AttentionPath
    prefill_attention: tuple[AttentionPath, ...]  # one per PREFILL_BUCKETS entry
    elementwise: ElementwisePath
    reasons: dict[str, str] = field(default_factory=dict, compare=False)  # decision -> why
    measured_ms: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)

    def prefill_path(self, max_kv_len: int) -> AttentionPath:
        for limit, path in zip(PREFILL_BUCKETS, self.prefill_attention):
            if max_kv_len <= limit:
                return path
        return self.prefill_attention[-1]

    def to_json(self) -> dict:
        d = asdict(self)
        d["matmul"] = self.matmul.value
        d["decode_attention"] = self.decode_attention.value
        d["prefill_attention"] = [p.value for p in self.prefill_attention]
        d["prefill_buckets"] = list(PREFILL_BUCKETS)
        d["elementwise"] = self.elementwise.value
        return d

    @staticmethod
    def from_json(d: dict) -> "CpuPlan":
        if list(d.get("prefill_buckets", ())) != list(PREFILL_BUCKETS):
            raise ValueError("prefill buckets changed")
        return CpuPlan(MatmulPath(d["matmul"]), AttentionPath(d["decode_attention"]),
                       tuple(AttentionPath(p) for p in d["prefill_attention"]),
                       ElementwisePath(d["elementwise"]), dict(d.get("reasons", {})),
                       {k: dict(v) for k, v in d.get("measured_ms", {}).items()})


class AttentionPaths:
    """Per step, the attention a plan asks for: (kernel object or None, float32 torch path?)."""

    def __init__(self, plan: CpuPlan, kernel: PagedAttentionKernel | None):
        self.plan = plan
        self._kernels: dict[AttentionPath, PagedAttentionKernel | None] = {
            AttentionPath.KERNEL: kernel, AttentionPath.KERNEL_PER_QUERY: None,
            AttentionPath.TORCH: None, AttentionPath.TORCH_FP32: None}
        if kernel is not None:
            per_query = copy.copy(kernel)
            per_query.tile_min = PER_QUERY_ONLY
            self._kernels[AttentionPath.KERNEL_PER_QUERY] = per_query

    def for_step(self, decode_only: bool,
                 max_prefill_kv: int) -> tuple[PagedAttentionKernel | None, torch.dtype | None]:
        """decode_only: every sequence adds one token; max_prefill_kv: the longest KV of the
        step's prefilling sequences. -> (kernel, torch compute dtype or None for the model's)."""
        path = self.plan.decode_attention if decode_only else self.plan.prefill_path(max_prefill_kv)
        upcast = torch.float32 if path is AttentionPath.TORCH_FP32 else None
        return self._kernels[path], upcast


def static_plan(matmul: MatmulPath, has_kernel: bool, has_fused: bool, why: str = "not measured") -> CpuPlan:
    """The plan without a measurement: our attention kernel and fused ops wherever
    they were built, else torch; matmul as given."""
    attn = AttentionPath.KERNEL if has_kernel else AttentionPath.TORCH
    return CpuPlan(matmul, attn, (attn,) * len(PREFILL_BUCKETS),
                   ElementwisePath.FUSED if has_fused else ElementwisePath.TORCH,
                   {"all": why})
