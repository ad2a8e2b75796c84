"""Load an HF-style directory (config.json + *.safetensors, sharded or not) into `CausalLM`.

Each HF tensor is copied straight into its slice of our fused weights (q/k/v rows of
`qkv_proj`, gate/up rows of `gate_up_proj`), converting dtype and device on the way.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..model_files.hf_config import ModelConfig
from .cpu_matmul import MatmulKernels
from .linear import NO_KERNELS, MatmulPath, default_path
from .model import CausalLM

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_targets(model: CausalLM) -> dict[str, torch.Tensor]:
    """HF weight name -> the tensor (often a row slice of a fused weight) it is copied into."""
    cfg = model.cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens,
                                    "model.norm.weight": model.norm}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out.update(_layer_targets(cfg, layer, p, q, kv, inter))
    return out


def _layer_targets(cfg: ModelConfig, layer, p: str, q: int, kv: int, inter: int) -> dict[str, torch.Tensor]:
    out = {p + "self_attn.o_proj.weight": layer.o_proj, p + "input_layernorm.weight": layer.input_norm}
    if cfg.fused_weights:  # Phi-3 stores them fused, in our row order
        out.update({p + "self_attn.qkv_proj.weight": layer.qkv_proj,
                    p + "mlp.gate_up_proj.weight": layer.gate_up_proj})
    else:
        out.update({
            p + "self_attn.q_proj.weight": layer.qkv_proj[:q],
            p + "self_attn.k_proj.weight": layer.qkv_proj[q:q + kv],
            p + "self_attn.v_proj.weight": layer.qkv_proj[q + kv:],
        })
    if layer.moe is not None:
        out.update(_expert_targets(cfg, layer.moe, p))
    elif not cfg.fused_weights:
        out.update({p + "mlp.gate_proj.weight": layer.gate_up_proj[:inter],
                    p + "mlp.up_proj.weight": layer.gate_up_proj[inter:],
                    p + "mlp.down_proj.weight": layer.down_proj})
    else:
        out[p + "mlp.down_proj.weight"] = layer.down_proj
    if cfg.gemma:  # post_attention_layernorm norms the attention output there
        out.update({p + "post_attention_layernorm.weight": layer.attn_out_norm,
                    p + "pre_feedforward_layernorm.weight": layer.post_norm,
                    p + "post_feedforward_layernorm.weight": layer.mlp_out_norm})
    else:
        out[p + "post_attention_layernorm.weight"] = layer.post_norm
    if layer.q_norm is not None:
        out.update({p + "self_attn.q_norm.weight": layer.q_norm,
                    p + "self_attn.k_norm.weight": layer.k_norm})
    if layer.qkv_bias is not None:
        out.update({p + "self_attn.q_proj.bias": layer.qkv_bias[:q],
                    p + "self_attn.k_proj.bias": layer.qkv_bias[q:q + kv],
                    p + "self_attn.v_proj.bias": layer.qkv_bias[q + kv:]})
    if layer.o_bias is not None:
        out[p + "self_attn.o_proj.bias"] = layer.o_bias
    return out


def _expert_targets(cfg: ModelConfig, moe, p: str) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down) -> their
    slices of the stacked expert weights."""
    inter = moe.spec.intermediate_size
    if cfg.architecture == "MixtralForCausalLM":
        base, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out = {base + "gate.weight": moe.router}
    if moe.shared_gate_up is not None:  # Qwen2-MoE
        s = moe.spec.shared_intermediate_size
        out.update({base + "shared_expert.gate_proj.weight": moe.shared_gate_up[:s],
                    base + "shared_expert.up_proj.weight": moe.shared_gate_up[s:],
                    base + "shared_expert.down_proj.weight": moe.shared_down,
                    base + "shared_expert_gate.weight": moe.shared_gate})
    for e in range(moe.spec.num_experts):
        x = f"{base}experts.{e}."
        out.update({x + names[0] + ".weight": moe.gate_up[e, :inter],
                    x + names[1] + ".weight": moe.gate_up[e, inter:],
                    x + names[2] + ".weight": moe.down[e]})
    return out


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def load_model(model_dir: str, dtype: torch.dtype, device: str | torch.device,
               max_positions: int | None = None, matmul: MatmulPath | None = None,
               kernels: MatmulKernels = NO_KERNELS) -> tuple[CausalLM, ModelConfig]:
    """Build the model for `model_dir` and fill every weight; errors name the offending tensor.
    `max_positions` bounds the RoPE table (default: the config's max_position_embeddings);
    `matmul`: the path the matmuls run on (model.use_matmul; `kernels`: ours that were
    built, for the paths that need them); None: linear.default_path."""
    cfg = ModelConfig.from_dir(model_dir)
    model = CausalLM(cfg, dtype, device, max_positions=max_positions)
    targets = weight_targets(model)
    files = safetensors_files(model_dir)
    names: dict[str, list[str]] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names[path] = list(f.keys())
    with torch.no_grad(), tqdm(total=sum(map(len, names.values())), desc="loading weights",
                               unit="tensor", disable=None) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names[path]:
                    bar.update(1)
                    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    dst = targets.pop(name, None)
                    if dst is None:
                        raise ValueError(f"{path}: unexpected weight {name!r} for {cfg.architecture}")
                    src = f.get_tensor(name)
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(f"{path}: weight {name!r} has shape {tuple(src.shape)}, "
                                         f"expected {tuple(dst.shape)}")
                    dst.copy_(src)
    if targets:
        missing = sorted(targets)
        raise ValueError(f"{model_dir}: {len(missing)} weights missing, e.g. {missing[:3]}")
    model.eval()
    model.use_matmul(matmul or default_path(dtype, device, kernels), kernels)
    return model, cfg
