"""Gemma 2 / Gemma 3 (text) GGUF metadata -> the config.json keys HF's Gemma configs read.

llama.cpp stores Gemma's norm weights with the +1 of Gemma's (1 + w) RMSNorm folded in
(undone in gguf_convert via `ArchSpec.norm_shift`), and fixes some parameters in code rather
than in the file; we apply the same rules:
- the query scale is head_dim ** -0.5, except for the 27B models (46 layers for Gemma 2, 62
  for Gemma 3), where it is (hidden / heads) ** -0.5;
- Gemma 2: every other layer (even ones) is windowed; soft-caps default to 50 / 30;
- Gemma 3: every 6th layer is full, the others windowed with RoPE base 10000 and no scaling
  (`attention.sliding_window_pattern` and `rope.freq_base_swa`, where a file has them, say
  otherwise); no window key means full attention everywhere.
"""

from __future__ import annotations

from .families import FULL, SLIDING
from .hf_config import UnsupportedModel

GELU_TANH = "gelu_pytorch_tanh"
LARGE_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models' depth: their query scale differs
GEMMA2_SOFTCAPS = (50.0, 30.0)  # attention, final: llama.cpp's defaults when a file has none
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_BASE = 10000.0

# llama.cpp names of the four Gemma norms per layer (ffn_norm is the pre-MLP norm here)
GEMMA_LAYER_NAMES = (("post_attention_norm", "post_attention_layernorm"),
                     ("ffn_norm", "pre_feedforward_layernorm"),
                     ("post_ffw_norm", "post_feedforward_layernorm"))


def gemma_config(meta, arch: str, cfg: dict) -> dict:
    """The base config `cfg` completed for GGUF architecture `arch` (a new dict)."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    scalar = hidden // heads if layers == LARGE_LAYERS[arch] else cfg["head_dim"]
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0) or None
    attn_cap, final_cap = GEMMA2_SOFTCAPS if arch == "gemma2" else (None, None)
    out: dict = {
        "hidden_act": GELU_TANH, "hidden_activation": GELU_TANH, "query_pre_attn_scalar": scalar,
        "sliding_window": window, "rms_norm_eps": meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "attn_logit_softcapping": _cap(meta, f"{arch}.attn_logit_softcapping", attn_cap),
        "final_logit_softcapping": _cap(meta, f"{arch}.final_logit_softcapping", final_cap),
    }
    if arch == "gemma2":
        out["layer_types"] = [SLIDING if window and i % 2 == 0 else FULL for i in range(layers)]
        return {**cfg, **out}
    out["layer_types"] = [SLIDING if window and sliding else FULL for sliding in _gemma3_pattern(meta, arch, layers)]
    full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    local = {"rope_type": "default",
             "rope_theta": meta.get_float(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_BASE)}
    out["rope_parameters"] = {FULL: full, SLIDING: local} if window else full
    return {**{k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}, **out}


def _gemma3_pattern(meta, arch: str, layers: int) -> list[bool]:
    """Per layer, whether it is windowed: an int n (every n-th layer full) or a bool per layer."""
    v = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(v, list):
        if len(v) != layers:
            raise UnsupportedModel(f"{meta.path}: sliding_window_pattern has {len(v)} entries for {layers} layers")
        return [bool(x) for x in v]
    n = int(v)  # llama.cpp's set_swa_pattern: 0 = all windowed
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _cap(meta, key: str, default: float | None) -> float | None:
    v = meta.get_float(key, default if default is not None else 0.0)
    return v or None
