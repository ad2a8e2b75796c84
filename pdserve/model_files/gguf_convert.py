"""Convert a GGUF file into an HF-style directory pdserve and transformers can both load.

Every tensor is dequantized to float32 and renamed to HF names; llama.cpp's q/k row
permutation (applied by its converter for the `llama` architecture only) is undone per head.
The tokenizer is rebuilt from the GGUF metadata (see gguf_tokenizer.py). Phi-3 keeps its
fused weights, and its longrope factors come from the rope_factors_* tensors.
Sliding windows: `{arch}.attention.sliding_window` where written; a Mistral 7B v0.1 file
written without it (llama architecture, RoPE base 10000, context past 4096) gets that
model's known 4096-token window rather than full attention. Experts (Mixtral, Qwen2/3-MoE)
are split back into HF's per-expert tensors (gguf_experts.py); Gemma 2/3 norms lose the +1
llama.cpp folds into them, and their config follows llama.cpp's rules (gguf_gemma.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from .gguf_experts import (
    MIXTRAL,
    QWEN2_MOE,
    QWEN3_MOE,
    ExpertNames,
    check_layout,
    expert_tensors,
    is_expert_tensor,
    moe_config,
)
from .gguf_gemma import GEMMA_LAYER_NAMES, gemma_config
from .gguf_tokenizer import GGUFTokenizerData, build_tokenizer, tokenizer_config
from .hf_config import UnsupportedModel

CONVERTER_VERSION = 2
MISTRAL_V01_WINDOW = 4096


@dataclass(frozen=True)
class ArchSpec:
    hf_architecture: str
    model_type: str
    unpermute_qk: bool  # llama.cpp permutes q/k rows for the llama architecture only
    layer_names: tuple[tuple[str, str], ...] = ()  # this architecture's own tensor names
    norm_shift: float = 0.0  # llama.cpp adds this to every *norm.weight (Gemma: 1)
    experts: ExpertNames | None = None  # HF names of routed experts, where the file has them


GGUF_ARCHITECTURES = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", True, experts=MIXTRAL),  # Mixtral: llama + experts
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", False),
    "qwen2moe": ArchSpec("Qwen2MoeForCausalLM", "qwen2_moe", False, experts=QWEN2_MOE),
    "qwen3moe": ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", False, experts=QWEN3_MOE),
    "gemma2": ArchSpec("Gemma2ForCausalLM", "gemma2", False, GEMMA_LAYER_NAMES, norm_shift=1.0),
    "gemma3": ArchSpec("Gemma3ForCausalLM", "gemma3_text", False, GEMMA_LAYER_NAMES, norm_shift=1.0),
    # Phi-3 keeps HF's fused q/k/v and gate/up weights (ffn_up holds gate rows, then up rows)
    "phi3": ArchSpec("Phi3ForCausalLM", "phi3", False,
                     (("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
}
ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFMetadata:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: str):
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default=None):
        f = self._fields.get(key)
        return default if f is None else f.contents()

    def get_float(self, key: str, default: float) -> float:
        """A float32 field as the decimal it was written from (9.9999997e-06 -> 1e-05)."""
        v = self.get(key)
        return default if v is None else float(str(np.float32(v)))

    def require(self, key: str):
        v = self.get(key)
        if v is None:
            raise UnsupportedModel(f"{self.path}: GGUF metadata has no {key!r}")
        return v


def hf_name(gguf_name: str, spec: ArchSpec | None = None) -> str:
    """llama.cpp tensor name -> HF transformers name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **dict(spec.layer_names if spec else ())}
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no HF equivalent in this converter")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head it stores rows (pair, half) as (half, pair)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert_tensors(reader: GGUFReader, spec: ArchSpec, n_heads: int, n_kv_heads: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise UnsupportedModel("GGUF with rope_freqs (llama3-style rope scaling) is not supported; "
                                   "use the HF directory instead")
        if t.name in ROPE_FACTORS:  # Phi-3 longrope: config values, see rope_factors
            continue
        check_layout(t.name)
        m = _LAYER_RE.fullmatch(t.name)
        expert = m is not None and is_expert_tensor(spec.experts, m.group(2))
        name = "" if expert else hf_name(t.name, spec)
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if expert:
            out.update(expert_tensors(spec.experts, int(m.group(1)), m.group(2), m.group(3), w))
            continue
        if spec.norm_shift and t.name.endswith("norm.weight"):
            w = w - np.float32(spec.norm_shift)
        if spec.unpermute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, n_heads)
        elif spec.unpermute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, n_kv_heads)
        out[name] = np.ascontiguousarray(w)
    return out


def rope_factors(reader: GGUFReader) -> dict[str, list[float]]:
    """longrope's per-dimension factors, stored as tensors: {"long_factor": [...], ...}."""
    return {ROPE_FACTORS[t.name]: [float(x) for x in np.asarray(dequantize(t.data, t.tensor_type)).reshape(-1)]
            for t in reader.tensors if t.name in ROPE_FACTORS}


def hf_config(meta: GGUFMetadata, spec: ArchSpec, arch: str, vocab_size: int, tied: bool,
              eos_ids: list[int], factors: dict[str, list[float]] | None = None,
              moe: dict | None = None) -> dict:
    """A config.json for transformers' AutoModelForCausalLM (and our ModelConfig); `moe`:
    the expert keys (gguf_experts.moe_config) where the file has experts."""
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise UnsupportedModel(f"{meta.path}: GGUF rope scaling {kind!r} is not supported")
    scaling = {"rope_type": "linear", "factor": meta.get_float(f"{arch}.rope.scaling.factor", 1.0)} \
        if kind == "linear" else None
    cfg = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get_float(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": scaling,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "torch_dtype": "float32",
    }
    if moe:
        cfg.update(architectures=[spec.experts.hf_architecture], model_type=spec.experts.model_type, **moe)
        if spec.experts is MIXTRAL:
            cfg["sliding_window"] = int(meta.get(f"{arch}.attention.sliding_window") or 0) or None
    elif spec.model_type == "llama":
        cfg["attention_bias"] = False
        window = sliding_window(meta, arch)
        if window:  # Mistral: Llama's layout plus a window on every layer
            cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    if spec.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        cfg["use_sliding_window"] = False
    if spec.model_type == "phi3":
        cfg.update(_phi3_config(meta, arch, cfg, factors or {}))
    if spec.norm_shift:
        cfg = gemma_config(meta, arch, cfg)
    return cfg


def _phi3_config(meta: GGUFMetadata, arch: str, cfg: dict, factors: dict[str, list[float]]) -> dict:
    """Partial rotary dims, window, and longrope (factors from the rope_factors_* tensors)."""
    rot = int(meta.get(f"{arch}.rope.dimension_count", cfg["head_dim"]))
    out: dict = {"partial_rotary_factor": rot / cfg["head_dim"],
                 "sliding_window": meta.get(f"{arch}.attention.sliding_window")}
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    if factors:
        if set(factors) != {"long_factor", "short_factor"} or not orig:
            raise UnsupportedModel(f"{meta.path}: longrope needs rope_factors_long, rope_factors_short "
                                   f"and rope.scaling.original_context_length")
        out["rope_scaling"] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(orig)}
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attn is not None:
            out["rope_scaling"]["attention_factor"] = meta.get_float(f"{arch}.rope.scaling.attn_factor", 1.0)
    return out


def sliding_window(meta: GGUFMetadata, arch: str) -> int | None:
    """The file's window; else Mistral 7B v0.1's known one where the file is that model."""
    w = meta.get(f"{arch}.attention.sliding_window")
    if w:
        return int(w)
    name = " ".join(str(meta.get(k) or "") for k in ("general.name", "general.basename")).lower()
    if "mistral" in name and meta.get_float(f"{arch}.rope.freq_base", 10000.0) == 10000.0 \
            and int(meta.get(f"{arch}.context_length", 2048)) > MISTRAL_V01_WINDOW:
        return MISTRAL_V01_WINDOW
    return None


def tokenizer_data(meta: GGUFMetadata, arch: str) -> GGUFTokenizerData:
    model = meta.require("tokenizer.ggml.model")
    return GGUFTokenizerData(
        model=model,
        pre=meta.get("tokenizer.ggml.pre", "default"),
        tokens=list(meta.require("tokenizer.ggml.tokens")),
        token_types=list(meta.get("tokenizer.ggml.token_type", [])),
        merges=list(meta.get("tokenizer.ggml.merges", [])),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),  # llama.cpp's defaults
        chat_template=meta.get("tokenizer.chat_template"),
        context_length=int(meta.get(f"{arch}.context_length", 2048)),
        scores=tuple(float(x) for x in meta.get("tokenizer.ggml.scores", [])),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
    )


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json for `gguf_path` into the existing directory `out_dir`."""
    reader = GGUFReader(gguf_path)
    meta = GGUFMetadata(reader, gguf_path)
    arch = meta.require("general.architecture")
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        raise UnsupportedModel(f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
                               f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    heads = int(meta.require(f"{arch}.attention.head_count"))
    tensors = convert_tensors(reader, spec, heads, int(meta.get(f"{arch}.attention.head_count_kv", heads)))
    tok_data = tokenizer_data(meta, arch)
    eos_ids = [i for i in (tok_data.eos_id, meta.get("tokenizer.ggml.eot_token_id")) if i is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    moe = None
    routers = spec.experts is not None and any(n.endswith(f".{spec.experts.base}gate.weight") for n in tensors)
    if spec.experts is not None and (spec.experts is not MIXTRAL or routers):
        moe = moe_config(meta, arch, spec.experts, tensors, int(meta.require(f"{arch}.block_count")))
    config = hf_config(meta, spec, arch, vocab_size, "lm_head.weight" not in tensors, eos_ids,
                       rope_factors(reader), moe)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    build_tokenizer(tok_data).save(os.path.join(out_dir, "tokenizer.json"))
    st = os.stat(gguf_path)
    docs = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": tok_data.bos_id, "eos_token_id": eos_ids or None},
        "tokenizer_config.json": tokenizer_config(tok_data),
        "pdserve_source.json": {"gguf": os.path.abspath(gguf_path), "size": st.st_size,
                                "mtime_ns": st.st_mtime_ns, "converter_version": CONVERTER_VERSION},
    }
    for name, doc in docs.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, ensure_ascii=False)
