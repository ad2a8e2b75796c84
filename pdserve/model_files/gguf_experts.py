"""Routed experts in GGUF files (Mixtral as llama.cpp's `llama` architecture, Qwen2-MoE,
Qwen3-MoE) -> HF's per-expert checkpoint names, plus the config keys they imply.

llama.cpp stacks each layer's experts into 3-D tensors `ffn_{gate,up,down}_exps` ([experts,
out, in] here; optionally gate and up fused as `ffn_gate_up_exps`, gate rows first) with the
router as `ffn_gate_inp`; Qwen2-MoE adds a shared expert (`ffn_*_shexp`) and its sigmoid gate
`ffn_gate_inp_shexp`. Routing is softmax, top-k; whether the top-k weights are renormalized
is fixed per architecture in llama.cpp (Mixtral and Qwen3-MoE yes, Qwen2-MoE no) unless the
file says `expert_weights_norm`. Layers are MoE where the file has a router for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .hf_config import UnsupportedModel

GATING_SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX
_OLD_LAYOUT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


@dataclass(frozen=True)
class ExpertNames:
    """Where one architecture's HF checkpoint keeps a layer's experts."""

    hf_architecture: str
    model_type: str
    base: str  # under model.layers.{i}.: "block_sparse_moe." (Mixtral) or "mlp." (Qwen)
    gate: str
    up: str
    down: str
    renormalize: bool  # llama.cpp's fixed choice for this architecture
    shared: bool = False  # Qwen2-MoE: shared expert + its gate


MIXTRAL = ExpertNames("MixtralForCausalLM", "mixtral", "block_sparse_moe.", "w1", "w3", "w2", True)
QWEN3_MOE = ExpertNames("Qwen3MoeForCausalLM", "qwen3_moe", "mlp.", "gate_proj", "up_proj", "down_proj", True)
QWEN2_MOE = ExpertNames("Qwen2MoeForCausalLM", "qwen2_moe", "mlp.", "gate_proj", "up_proj", "down_proj",
                        False, shared=True)

EXPERT_KINDS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
SHARED_KINDS = {"ffn_gate_inp_shexp": "shared_expert_gate", "ffn_gate_shexp": "shared_expert.gate_proj",
                "ffn_up_shexp": "shared_expert.up_proj", "ffn_down_shexp": "shared_expert.down_proj"}


def is_expert_tensor(names: ExpertNames | None, kind: str) -> bool:
    return names is not None and (kind in EXPERT_KINDS or (names.shared and kind in SHARED_KINDS))


def check_layout(gguf_name: str) -> None:
    """Refuse the 2023 per-expert tensor names (`blk.N.ffn_gate.E.weight`) clearly."""
    if _OLD_LAYOUT.fullmatch(gguf_name):
        raise UnsupportedModel(f"GGUF tensor {gguf_name!r}: experts stored one tensor each (an old "
                               f"Mixtral GGUF layout) are not supported; re-convert with a current llama.cpp")


def expert_tensors(names: ExpertNames, layer: int, kind: str, suffix: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """HF tensors for one GGUF expert tensor `blk.{layer}.{kind}.{suffix}`."""
    base = f"model.layers.{layer}.{names.base}"
    if suffix != "weight":
        raise UnsupportedModel(f"GGUF tensor blk.{layer}.{kind}.{suffix}: expert biases are not supported")
    if kind in SHARED_KINDS:
        return {f"{base}{SHARED_KINDS[kind]}.weight": w.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else w}
    if kind == "ffn_gate_inp":
        return {f"{base}gate.weight": w}
    if w.ndim != 3:
        raise UnsupportedModel(f"GGUF tensor blk.{layer}.{kind}: expected [experts, out, in], got {list(w.shape)}")
    if kind == "ffn_gate_up_exps":
        inter = w.shape[1] // 2
        parts = {names.gate: w[:, :inter], names.up: w[:, inter:]}
    else:
        parts = {{"ffn_gate_exps": names.gate, "ffn_up_exps": names.up, "ffn_down_exps": names.down}[kind]: w}
    return {f"{base}experts.{e}.{proj}.weight": np.ascontiguousarray(t[e])
            for proj, t in parts.items() for e in range(t.shape[0])}


def moe_config(meta, arch: str, names: ExpertNames, tensors: dict[str, np.ndarray], num_layers: int) -> dict:
    """config.json keys of the MoE family: experts, top-k, widths, which layers are MoE."""
    moe_layers = [i for i in range(num_layers) if f"model.layers.{i}.{names.base}gate.weight" in tensors]
    if not moe_layers:
        raise UnsupportedModel(f"{meta.path}: GGUF architecture {arch!r} with no expert tensors")
    dense = [i for i in range(num_layers) if i not in moe_layers]
    if dense and names is MIXTRAL:
        raise UnsupportedModel(f"{meta.path}: layers {dense} have a dense MLP and the others experts; "
                               f"Mixtral has experts on every layer")
    first = f"model.layers.{moe_layers[0]}.{names.base}"
    experts = tensors[first + "gate.weight"].shape[0]
    declared = int(meta.require(f"{arch}.expert_count"))
    top_k = int(meta.require(f"{arch}.expert_used_count"))
    if declared != experts:
        raise UnsupportedModel(f"{meta.path}: expert_count {declared} but the router has {experts} rows")
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != GATING_SOFTMAX:
        raise UnsupportedModel(f"{meta.path}: expert_gating_func {gating} is not supported (softmax only)")
    if meta.get_float(f"{arch}.expert_weights_scale", 1.0) not in (0.0, 1.0):
        raise UnsupportedModel(f"{meta.path}: expert_weights_scale {meta.get(f'{arch}.expert_weights_scale')} "
                               f"is not supported")
    inter = tensors[f"{first}experts.0.{names.gate}.weight"].shape[0]
    renorm = bool(meta.get(f"{arch}.expert_weights_norm", names.renormalize))
    if names is MIXTRAL:
        if not renorm:
            raise UnsupportedModel(f"{meta.path}: Mixtral without renormalized expert weights is not supported")
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": inter}
    out = {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
           "norm_topk_prob": renorm, "decoder_sparse_step": 1, "mlp_only_layers": dense}
    if names.shared:
        shared = tensors.get(f"{first}shared_expert.gate_proj.weight")
        if shared is None:
            raise UnsupportedModel(f"{meta.path}: Qwen2-MoE layer {moe_layers[0]} has no shared expert")
        out["shared_expert_intermediate_size"] = shared.shape[0]
    return out
