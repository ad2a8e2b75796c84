"""What this machine's CPU is, as far as the engine's choices care (stdlib only).

Read from /proc/cpuinfo on Linux: the model name and the ISA flags that decide which kernels
can run (AVX2, AVX-512 and its BF16, AMX); empty elsewhere. Shown in server_info and part of
the key of the calibration cache (engine/calibration.py), so another CPU measures again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# the flags that change which kernel exists or wins; others (sse, aes, ...) do not matter here
ISA_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                       "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
                       "amx_int8", "amx_fp16", "sve", "asimd", "bf16"})


def _cpuinfo_field(name: str, cpuinfo: str) -> str:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    return frozenset((_cpuinfo_field("flags", cpuinfo) or _cpuinfo_field("Features", cpuinfo)).split())


@dataclass(frozen=True)
class HostInfo:
    model_name: str
    isa_flags: frozenset[str]
    cores: int  # CPUs this process may run on

    @staticmethod
    def read(cpuinfo: str = "/proc/cpuinfo") -> "HostInfo":
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        name = _cpuinfo_field("model name", cpuinfo) or _cpuinfo_field("Model", cpuinfo) or "unknown"
        # cloud VMs name very different CPUs alike ("AMD EPYC" for Zen 1 and Zen 5): the family
        # and model tell them apart, in what is shown and in the calibration cache's key
        ids = [(k, _cpuinfo_field(f, cpuinfo)) for k, f in (("family", "cpu family"), ("model", "model\t"),
                                                           ("stepping", "stepping"))]
        if any(v for _, v in ids):
            name += " (" + " ".join(f"{k} {v}" for k, v in ids if v) + ")"
        return HostInfo(name, cpu_flags(cpuinfo) & ISA_FLAGS, cores)

    def summary(self) -> dict[str, Any]:
        amx = {"amx_tile", "amx_bf16"} <= self.isa_flags
        return {"cpu": self.model_name, "isa": sorted(self.isa_flags), "amx": amx,
                "avx512_bf16": "avx512_bf16" in self.isa_flags, "cores": self.cores}
