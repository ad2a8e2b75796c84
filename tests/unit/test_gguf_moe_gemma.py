"""GGUF round trips of Gemma 2, Gemma 3 (text), Mixtral, Qwen2-MoE and Qwen3-MoE: a tiny HF
model (tests/harness/tiny_families.py configs) is written as llama.cpp writes it (experts stacked as
3-D tensors, Gemma norms with +1 folded in, q/k rows permuted for the llama architecture,
config in metadata keys), converted by our loader, and must give HF's greedy tokens for 32
new tokens in float32. Files we cannot represent are refused with the reason."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_gguf_families import TOKENS, finish_gguf  # noqa: E402

from pdserve.model_files import ModelConfig, resolve_model  # noqa: E402
from pdserve.model_files.resolve import ModelNotFound  # noqa: E402
from tests.harness.tiny_families import TINY, family_config, randomize  # noqa: E402

GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp"}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
PROMPT = [5, 17, 33, 8, 91, 4, 60, 23, 11, 70, 3, 99]  # 12 + 32 tokens: past the 12-token windows


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf, arch: str, fuse_experts: bool = False) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of `hf` (transformers 5 keeps experts fused: gate_up_proj, down_proj)."""
    cfg, gemma = hf.config, arch.startswith("gemma")
    names = GEMMA_LAYER if gemma else LAYER
    out: dict[str, np.ndarray] = {}
    for name, t in hf.state_dict().items():
        w = t.detach().float().numpy().copy()
        if gemma and name.endswith("norm.weight"):
            w = w + 1
        if name in GLOBAL:
            if name != "lm_head.weight" or not cfg.tie_word_embeddings:
                out[GLOBAL[name] + ".weight"] = w
            continue
        _, _, i, *part = name.split(".")
        key, kind = ".".join(part[:-1]), part[-1]
        if arch == "llama" and key in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _permute(w, cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads)
        if key == "mlp.experts" and kind == "gate_up_proj":
            half = w.shape[1] // 2
            pairs = {"ffn_gate_up_exps": w} if fuse_experts else \
                {"ffn_gate_exps": w[:, :half], "ffn_up_exps": w[:, half:]}
            out.update({f"blk.{i}.{k}.weight": v for k, v in pairs.items()})
        elif key == "mlp.experts":
            out[f"blk.{i}.ffn_down_exps.weight"] = w
        else:
            out[f"blk.{i}.{names[key]}.{kind}"] = w
    return out


def write_gguf(path: str, arch: str, hf, tensors: dict[str, np.ndarray], extra) -> None:
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    extra(w)
    finish_gguf(w, tensors)


def _gemma3_config():
    """Gemma 3 as llama.cpp assumes it: every 6th layer full, local RoPE base 10000 (no
    scaling), query_pre_attn_scalar = head_dim; linear scaling on the full layers."""
    return transformers.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6, "vocab_size": len(TOKENS)},
                                         sliding_window=12, query_pre_attn_scalar=TINY["head_dim"],
                                         rope_parameters={
                                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _gemma2_config():
    cfg = family_config("gemma2", vocab_size=len(TOKENS))
    cfg.query_pre_attn_scalar = cfg.head_dim  # what llama.cpp assumes below 27B (not in the file)
    return cfg


def _theta(cfg) -> float:
    return float((cfg.rope_parameters or {}).get("rope_theta", 10000.0))


def _moe_keys(c, shared: bool = False):
    def extra(w):
        w.add_rope_freq_base(_theta(c))
        w.add_expert_count(c.num_experts if hasattr(c, "num_experts") else c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if hasattr(c, "moe_intermediate_size"):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if shared:
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    return extra


def _gemma2_keys(c):
    def extra(w):
        w.add_rope_freq_base(_theta(c))
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    return extra


def _gemma3_keys(c):
    def extra(w):
        w.add_rope_freq_base(1e6)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
        w.add_sliding_window(c.sliding_window)
    return extra


# family -> (GGUF architecture, HF config, metadata writer, fuse gate/up experts, expected ModelConfig fields)
CASES = {
    "gemma2": ("gemma2", _gemma2_config, _gemma2_keys, False,
               dict(gemma=True, attn_softcap=5.0, final_softcap=30.0, windows=[12, None, 12, None])),
    "gemma3": ("gemma3", _gemma3_config, _gemma3_keys, False,
               dict(gemma=True, qk_norm=True, windows=[12] * 5 + [None], sliding_rope_theta=1e4)),
    "mixtral": ("llama", lambda: family_config("mixtral", vocab_size=len(TOKENS)), _moe_keys, False,
                dict(architecture="MixtralForCausalLM", moe_layers=(0, 1, 2, 3))),
    "qwen2_moe": ("qwen2moe", lambda: family_config("qwen2_moe", vocab_size=len(TOKENS)),
                  lambda c: _moe_keys(c, shared=True), False, dict(moe_layers=(1, 3), shared=96)),
    "qwen3_moe": ("qwen3moe", lambda: family_config("qwen3_moe", vocab_size=len(TOKENS)), _moe_keys, True,
                  dict(moe_layers=(1, 2, 3), renormalize=True)),
}


def _hf(config):
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, 7)
    return hf.eval()


def _devices():
    from test_model_families import DEVICES
    return DEVICES


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("family", list(CASES))
def test_gguf_greedy_matches_hf(tmp_path, family, device):
    from test_model_families import _ours

    arch, make_config, keys, fuse, want_cfg = CASES[family]
    hf = _hf(make_config())
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_gguf(path, arch, hf, gguf_tensors(hf, arch, fuse), keys(hf.config))
    out = resolve_model(path, cache_dir=str(tmp_path / "cache"))
    ours = ModelConfig.from_dir(out)
    assert ours.architecture == want_cfg.get("architecture", type(hf).__name__)
    if "windows" in want_cfg:
        assert [ours.layer_window(i) for i in range(ours.num_layers)] == want_cfg["windows"]
        assert ours.scale == hf.config.query_pre_attn_scalar ** -0.5
    for field in ("gemma", "qk_norm", "attn_softcap", "final_softcap", "sliding_rope_theta"):
        if field in want_cfg:
            assert getattr(ours, field) == want_cfg[field], field
    if "moe_layers" in want_cfg:
        assert ours.moe.layers == want_cfg["moe_layers"]
        assert ours.moe.shared_intermediate_size == want_cfg.get("shared", 0)
        assert ours.moe.renormalize == want_cfg.get("renormalize", family == "mixtral")
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert _ours(out, "float32", [PROMPT], device=device) == [want]


def test_gemma3_window_pattern_key(tmp_path):
    """`attention.sliding_window_pattern`, where a file has it, replaces the every-6th rule."""
    hf = _hf(_gemma3_config())
    path = str(tmp_path / "pattern.gguf")

    def extra(w):
        _gemma3_keys(hf.config)(w)
        w.add_sliding_window_pattern(3)
    write_gguf(path, "gemma3", hf, gguf_tensors(hf, "gemma3"), extra)
    cfg = ModelConfig.from_dir(resolve_model(path, cache_dir=str(tmp_path / "cache")))
    assert [cfg.layer_window(i) for i in range(6)] == [12, 12, None, 12, 12, None]


@pytest.fixture(scope="module")
def mixtral():
    return _hf(family_config("mixtral", vocab_size=len(TOKENS)))


def _drop_layer1_experts(t):
    t = {k: v for k, v in t.items() if not k.startswith("blk.1.ffn_")}
    inter, hidden = TINY["intermediate_size"], TINY["hidden_size"]
    t.update({"blk.1.ffn_gate.weight": np.zeros((inter, hidden)), "blk.1.ffn_up.weight": np.zeros((inter, hidden)),
              "blk.1.ffn_down.weight": np.zeros((hidden, inter))})
    return t


def _per_expert_layout(t):
    w = t.pop("blk.0.ffn_gate_exps.weight")
    t.update({f"blk.0.ffn_gate.{e}.weight": w[e] for e in range(w.shape[0])})
    return t


@pytest.mark.parametrize("change, keys, message", [
    (_drop_layer1_experts, None, "have a dense MLP"),
    (None, lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID), "expert_gating_func 2"),
    (_per_expert_layout, None, "one tensor each"),
])
def test_mixtral_gguf_refusals(tmp_path, mixtral, change, keys, message):
    tensors = gguf_tensors(mixtral, "llama")
    tensors = change(tensors) if change else tensors

    def extra(w):
        _moe_keys(mixtral.config)(w)
        if keys:
            keys(w)
    path = str(tmp_path / "bad.gguf")
    write_gguf(path, "llama", mixtral, tensors, extra)
    with pytest.raises(ModelNotFound, match=message):
        resolve_model(path, cache_dir=str(tmp_path / "cache"))


class _NoKeys:
    """GGUF metadata with no optional keys: llama.cpp's fixed rules apply."""

    path = "bare.gguf"

    def get(self, key, default=None):
        return default

    def get_float(self, key, default):
        return default


def test_gemma_rules_without_keys():
    from pdserve.model_files.gguf_gemma import gemma_config

    gemma2_27b = {"num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32, "head_dim": 128,
                  "rope_theta": 1e4, "rope_scaling": None}
    cfg = gemma_config(_NoKeys(), "gemma2", gemma2_27b)
    assert cfg["query_pre_attn_scalar"] == 144  # 27B: hidden / heads, as llama.cpp (and HF's config) has it
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert set(cfg["layer_types"]) == {"full_attention"}  # no window key: full attention
    assert gemma_config(_NoKeys(), "gemma2", {**gemma2_27b, "num_hidden_layers": 42})["query_pre_attn_scalar"] == 128
    cfg3 = gemma_config(_NoKeys(), "gemma3", {**gemma2_27b, "num_hidden_layers": 26})
    assert (cfg3["attn_logit_softcapping"], cfg3["final_logit_softcapping"]) == (None, None)
