"""`ModelConfig`: the decoder shape pdserve needs, parsed from an HF config.json (torch-free).

Reads both the classic layout (`rope_theta` + `rope_scaling`) and transformers 5's
`rope_parameters` (flat, or per layer type as Gemma 3 writes it), per-layer sliding windows
(`layer_types`, else the family's rule in families.py), and collects every EOS id from
config.json and generation_config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..core.pd_vocab import KvDtype
from .families import ACTIVATIONS, FAMILIES, FULL, SLIDING, MLPKind, WindowRule, default_layer_types

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# rope_type -> keys its parameters must have
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of an MoE family: each token's MLP is the weighted sum of its top_k
    experts' SwiGLU outputs, plus (Qwen2-MoE) a shared expert scaled by a sigmoid gate."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral always; Qwen3: norm_topk_prob)
    float32_weights: bool  # Mixtral scales expert outputs by float32 weights; Qwen3-MoE rounds them first
    layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP
    shared_intermediate_size: int = 0  # the shared expert's width (0: none)


class UnsupportedModel(ValueError):
    """The config describes a model this engine cannot run; the message says what and why."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None = default RoPE; else has "rope_type" in ROPE_TYPES
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # the window of the layers layer_types marks sliding
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" / "sliding_attention"
    # RoPE of sliding layers where it differs (Gemma 3's local base frequency); else None
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims
    qk_norm: bool = False
    gemma: bool = False  # see families.Family
    fused_weights: bool = False
    hidden_act: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # the same on the logits
    torch_dtype: str | None = None  # the checkpoint's dtype, a KvDtype value, if stated and served
    moe: MoESpec | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_window(self, i: int) -> int | None:
        """Keys layer i attends back over (its own included), or None for full attention."""
        if self.sliding_window and self.layer_types and self.layer_types[i] == SLIDING:
            return self.sliding_window
        return None

    def layer_rope(self, i: int) -> tuple[float, dict | None]:
        """(theta, scaling) of layer i's RoPE."""
        if self.sliding_rope_theta is not None and self.layer_window(i) is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    def fingerprint(self) -> dict:
        """What two workers must agree on to exchange KV pages: the pages' shape and what
        the stored keys mean (RoPE already applied, per-layer windows)."""
        return {"architecture": self.architecture, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "layer_windows": [self.layer_window(i) for i in range(self.num_layers)],
                "rope": [self.rope_theta, self.rope_scaling, self.sliding_rope_theta,
                         self.sliding_rope_scaling, self.rotary_dim]}

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        """Parse `model_dir`/config.json (+ generation_config.json when present)."""
        path = os.path.join(model_dir, "config.json")
        gen_path = os.path.join(model_dir, "generation_config.json")
        raw, gen = _read_json(path), (_read_json(gen_path) if os.path.exists(gen_path) else {})
        return cls.from_dict(raw, gen, source=path)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None, source: str = "config") -> "ModelConfig":
        try:
            return cls._parse(raw, generation or {}, source)
        except KeyError as e:
            raise UnsupportedModel(f"{source}: required field {e} is missing") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, UnsupportedModel):
                raise
            raise UnsupportedModel(f"{source}: {e}") from None

    @classmethod
    def _parse(cls, raw: dict, generation: dict, source: str) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in FAMILIES:
            raise UnsupportedModel(
                f"{source}: architecture {arch or '(none)'!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        fam = FAMILIES[arch]
        if raw.get("mlp_bias"):
            raise UnsupportedModel(f"{source}: mlp_bias=true is not supported")
        if raw.get("use_bidirectional_attention"):
            raise UnsupportedModel(f"{source}: use_bidirectional_attention=true (an embedding model) "
                                   f"is not supported; this server generates causally")
        act = raw.get(fam.act_key) or raw.get("hidden_act") or fam.default_act
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"{source}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        qkv_bias, o_bias = fam.qkv_bias, fam.o_bias
        if raw.get("attention_bias"):  # Llama-style flag: bias on q, k, v and o
            qkv_bias = o_bias = True
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        (rope_theta, rope_scaling), local = _ropes(raw, source)
        window = raw.get("sliding_window")
        if fam.window_rule is WindowRule.QWEN and not raw.get("use_sliding_window", False):
            window = None
        types = tuple(raw.get("layer_types") or default_layer_types(fam.window_rule, raw, layers))
        if len(types) != layers or set(types) - {FULL, SLIDING}:
            raise UnsupportedModel(f"{source}: layer_types {list(types)} is not {layers} of "
                                   f"{FULL!r} / {SLIDING!r}")
        if SLIDING in types and not window:
            types = (FULL,) * layers
        prf = float(raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get(
            "partial_rotary_factor") or 1.0)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if not 0 < prf <= 1 or int(head_dim * prf) % 2:
            raise UnsupportedModel(f"{source}: partial_rotary_factor {prf} does not give an even "
                                   f"rotary dimension of head_dim {head_dim}")
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", fam.gemma)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            bos_token_id=_opt_int(raw.get("bos_token_id", generation.get("bos_token_id"))),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            sliding_window=int(window) if window and SLIDING in types else None,
            layer_types=types,
            sliding_rope_theta=None if local is None else local[0],
            sliding_rope_scaling=None if local is None else local[1],
            partial_rotary_factor=prf,
            qk_norm=fam.qk_norm,
            gemma=fam.gemma,
            fused_weights=fam.fused_weights,
            hidden_act=act,
            attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if fam.gemma else None,
            attn_softcap=_opt_float(raw.get("attn_logit_softcapping")) if fam.gemma else None,
            final_softcap=_opt_float(raw.get("final_logit_softcapping")) if fam.gemma else None,
            torch_dtype=_dtype_name(raw.get("dtype") or raw.get("torch_dtype")),
            moe=_moe(arch, raw, layers, source) if fam.mlp is MLPKind.MOE else None,
        )


def _moe(arch: str, raw: dict, layers: int, source: str) -> MoESpec:
    if arch == "MixtralForCausalLM":
        spec = MoESpec(int(raw.get("num_local_experts", 8)), int(raw.get("num_experts_per_tok", 2)),
                       int(raw["intermediate_size"]), True, True, tuple(range(layers)))
    else:  # Qwen2/3-MoE: experts every decoder_sparse_step-th layer, except mlp_only_layers
        step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or ())
        experts = raw.get("num_experts") or raw["num_local_experts"]  # hub configs / transformers 5
        spec = MoESpec(int(experts), int(raw.get("num_experts_per_tok", 8)),
                       int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False)), False,
                       tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
                       int(raw.get("shared_expert_intermediate_size") or 0)
                       if arch == "Qwen2MoeForCausalLM" else 0)
    if not 0 < spec.top_k <= spec.num_experts:
        raise UnsupportedModel(f"{source}: num_experts_per_tok {spec.top_k} of {spec.num_experts} experts")
    if raw.get("shared_expert_intermediate_size") and not spec.shared_intermediate_size:
        raise UnsupportedModel(f"{source}: shared experts are not supported for {arch}")
    return spec


def context_limit(cfg: ModelConfig, requested: int, allow_longer: bool) -> int:
    """The context length to serve: `requested` (0 = the model's max_position_embeddings).
    Longer than the model's is refused unless `allow_longer` (SGLang's
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN / vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    limit = cfg.max_position_embeddings
    if requested <= 0:
        return limit
    if requested > limit and not allow_longer:
        raise UnsupportedModel(
            f"--context-length {requested} is above the model's max_position_embeddings {limit}; "
            f"positions past it were never trained (outputs may be garbage). Set "
            f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to allow it")
    return requested


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"cannot read {path}: {e}") from None


def _ropes(raw: dict, source: str) -> tuple[tuple[float, dict | None], tuple[float, dict | None] | None]:
    """((theta, scaling) of full layers, (theta, scaling) of sliding layers or None when the
    same) from the classic keys or `rope_parameters`, flat or per layer type."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    if FULL in params or SLIDING in params:  # transformers 5, Gemma 3
        full = _rope(raw, dict(params.get(FULL) or {}), source)
        local = _rope({}, dict(params.get(SLIDING) or {}), source)
        return full, local
    full = _rope(raw, params, source)
    if raw.get("rope_local_base_freq") is not None:  # Gemma 3, classic keys
        return full, (float(raw["rope_local_base_freq"]), None)
    return full, None


def _rope(raw: dict, params: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """(rope_theta, normalized scaling dict or None) of one layer kind."""
    scaling: dict[str, Any] = dict(raw.get("rope_scaling") or params)
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    for k in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(k, None)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{source}: rope scaling {kind!r} is not supported; "
                               f"supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    if "original_max_position_embeddings" not in scaling and raw.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]  # Phi-3
    missing = [k for k in ROPE_TYPES[kind] if scaling.get(k) is None]
    if missing:
        raise UnsupportedModel(f"{source}: rope scaling {kind!r} needs {', '.join(missing)}")
    return theta, {"rope_type": kind, **scaling}


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _dtype_name(v: Any) -> str | None:
    """A checkpoint's torch_dtype if we serve it (KvDtype.parse), else None."""
    try:
        return KvDtype.parse(str(v)).value if v else None
    except ValueError:
        return None


def _opt_int(v: Any) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return None if v is None else int(v)


def _eos_ids(*sources: Any) -> tuple[int, ...]:
    out: list[int] = []
    for v in sources:
        for x in (v if isinstance(v, list) else [v]):
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)
