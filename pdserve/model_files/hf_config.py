"""`ModelConfig`: the decoder shape pdserve needs, parsed from an HF config.json (torch-free).

Reads both the classic layout (`rope_theta` + `rope_scaling`) and transformers 5's
`rope_parameters`, and collects every EOS id from config.json and generation_config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# architecture -> (qkv bias by default, o_proj bias by default)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
}
ROPE_TYPES = ("default", "linear", "llama3")


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
    sliding_window: int | None = None  # Mistral v0.1; attention here is always full

    def fingerprint(self) -> dict:
        """What two workers must agree on to exchange KV pages."""
        return {"architecture": self.architecture, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

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
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"{source}: architecture {arch or '(none)'!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("mlp_bias"):
            raise UnsupportedModel(f"{source}: mlp_bias=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        qkv_bias, o_bias = SUPPORTED_ARCHITECTURES[arch]
        if raw.get("attention_bias"):  # Llama-style flag: bias on q, k, v and o
            qkv_bias = o_bias = True
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope_theta, rope_scaling = _rope(raw, source)
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            bos_token_id=_opt_int(raw.get("bos_token_id", generation.get("bos_token_id"))),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            sliding_window=int(window) if window else None,
        )


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"cannot read {path}: {e}") from None


def _rope(raw: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, normalized scaling dict or None) from either config layout."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    scaling: dict[str, Any] = dict(raw.get("rope_scaling") or params)
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling.pop("rope_theta", None)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{source}: rope scaling {kind!r} is not supported; supported: {ROPE_TYPES}")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **scaling}


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
