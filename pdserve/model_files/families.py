"""What each supported architecture adds to the Llama baseline (torch-free).

A `Family` names the structural choices `ModelConfig` cannot read from config.json alone:
default biases, per-head q/k norms, Gemma's norm/embedding conventions, fused checkpoint
weights, the MLP kind, and how layers get sliding windows when config.json has no
`layer_types` (HF transformers' rule for that architecture).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WindowRule(enum.Enum):
    """Which layers use `sliding_window` when config.json lists no `layer_types`."""

    NONE = "none"  # never windowed
    ALL = "all"  # Mistral, Phi-3: every layer, when sliding_window is set
    QWEN = "qwen"  # only with use_sliding_window, layers from max_window_layers on
    GEMMA2 = "gemma2"  # alternating: even layers windowed
    GEMMA3 = "gemma3"  # every sliding_window_pattern-th layer (default 6) is full


class MLPKind(enum.Enum):
    DENSE = "dense"
    MOE = "moe"  # routed experts (Mixtral, Qwen3-MoE): engine/moe.py


@dataclass(frozen=True)
class Family:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # (1 + w) norms, embeddings * sqrt(hidden), norms around attn and MLP
    fused_weights: bool = False  # Phi-3: checkpoint holds qkv_proj and gate_up_proj fused
    window_rule: WindowRule = WindowRule.NONE
    act_key: str = "hidden_act"  # config.json key of the MLP activation
    default_act: str = "silu"
    mlp: MLPKind = MLPKind.DENSE


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(window_rule=WindowRule.ALL),
    "Qwen2ForCausalLM": Family(qkv_bias=True, window_rule=WindowRule.QWEN),
    "Qwen3ForCausalLM": Family(qk_norm=True, window_rule=WindowRule.QWEN),
    "Phi3ForCausalLM": Family(fused_weights=True, window_rule=WindowRule.ALL),
    "Gemma2ForCausalLM": Family(gemma=True, window_rule=WindowRule.GEMMA2,
                                act_key="hidden_activation", default_act="gelu_pytorch_tanh"),
    "Gemma3ForCausalLM": Family(gemma=True, qk_norm=True, window_rule=WindowRule.GEMMA3,
                                act_key="hidden_activation", default_act="gelu_pytorch_tanh"),
    "MixtralForCausalLM": Family(window_rule=WindowRule.ALL, mlp=MLPKind.MOE),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, window_rule=WindowRule.QWEN, mlp=MLPKind.MOE),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, window_rule=WindowRule.QWEN, mlp=MLPKind.MOE),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

SLIDING, FULL = "sliding_attention", "full_attention"


def default_layer_types(rule: WindowRule, raw: dict, num_layers: int) -> list[str]:
    """HF's per-layer attention kinds for a config.json without `layer_types`."""
    if rule is WindowRule.ALL and raw.get("sliding_window"):
        return [SLIDING] * num_layers
    if rule is WindowRule.QWEN and raw.get("use_sliding_window", False) and raw.get("sliding_window"):
        start = int(raw.get("max_window_layers", 28))
        return [SLIDING if i >= start else FULL for i in range(num_layers)]
    if rule is WindowRule.GEMMA2:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if rule is WindowRule.GEMMA3:
        every = int(raw.get("sliding_window_pattern", 6))
        return [SLIDING if (i + 1) % every else FULL for i in range(num_layers)]
    return [FULL] * num_layers
