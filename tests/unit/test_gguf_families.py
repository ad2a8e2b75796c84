"""GGUF files of the newer families: Qwen3 (q/k norms) and Phi-3 (fused weights, partial
RoPE, longrope factors as tensors) GGUFs convert into directories whose greedy tokens equal
HF's on the original weights; a Mistral 7B v0.1 GGUF without window
metadata gets its known 4096-token window, while its later versions keep full attention."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve.model_files import ModelConfig, resolve_model  # noqa: E402
from pdserve.model_files.gguf_tokenizer import byte_alphabet  # noqa: E402

TOKENS = [byte_alphabet()[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def _gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, i, *part, kind = hf.split(".")
    return f"blk.{i}.{LAYER['.'.join(part)]}.{kind}"


def _write(path: str, arch: str, cfg: dict, weights: dict[str, np.ndarray], name: str = "",
           extra=None) -> None:
    w = gguf.GGUFWriter(path, arch)
    if extra:
        extra(w)
    if name:
        w.add_name(name)
    w.add_block_count(cfg["layers"])
    w.add_context_length(cfg["context"])
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(cfg["inter"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(1e-5)
    finish_gguf(w, {_gguf_name(hf): t for hf, t in weights.items()})


def finish_gguf(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """Add the byte-level test vocabulary (TOKENS) and the float32 tensors, then write the file."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * 256 + [3] * 3)
    w.add_token_merges([])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


QWEN3 = dict(layers=2, context=256, hidden=64, inter=128, heads=4, kv_heads=2, head_dim=32, theta=1e6)


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    """(HF float32 model, converted dir) of one tiny random Qwen3."""
    c = QWEN3
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(TOKENS), hidden_size=c["hidden"], intermediate_size=c["inter"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"], max_position_embeddings=c["context"], rope_theta=c["theta"],
        rms_norm_eps=1e-5, tie_word_embeddings=False))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in n else
                    (1.0 if "embed" in n else 0.15) * torch.randn(p.shape, generator=g))
    root = tmp_path_factory.mktemp("gguf-qwen3")
    path = str(root / "Tiny-Qwen3.gguf")
    _write(path, "qwen3", c, {n: p.detach().numpy() for n, p in hf.state_dict().items()})
    return hf.eval(), resolve_model(path, cache_dir=str(root / "cache"))


def test_qwen3_gguf_config(qwen3_gguf):
    _, out = qwen3_gguf
    cfg = ModelConfig.from_dir(out)
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.rope_theta) == ("Qwen3ForCausalLM", True, 32, 1e6)
    assert [cfg.layer_window(i) for i in range(2)] == [None, None]


def test_qwen3_gguf_greedy_matches_hf(qwen3_gguf):
    from test_model_families import _ours

    hf, out = qwen3_gguf
    prompt = [5, 17, 33, 8, 91, 4, 60, 23, 11, 70, 3, 99]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert _ours(out, "float32", [prompt]) == [want]


LLAMA = dict(layers=1, hidden=16, inter=32, heads=2, kv_heads=1, head_dim=8)


def _llama_weights() -> dict[str, np.ndarray]:
    h, hd, rng = LLAMA["hidden"], LLAMA["head_dim"], np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(len(TOKENS), h), "model.norm.weight": r(h), "lm_head.weight": r(len(TOKENS), h)}
    shapes = {"self_attn.q_proj": (2 * hd, h), "self_attn.k_proj": (hd, h), "self_attn.v_proj": (hd, h),
              "self_attn.o_proj": (h, 2 * hd), "mlp.gate_proj": (32, h), "mlp.up_proj": (32, h),
              "mlp.down_proj": (h, 32), "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    w.update({f"model.layers.0.{k}.weight": r(*s) for k, s in shapes.items()})
    return w


@pytest.mark.parametrize("name, theta, context, window", [
    ("Mistral-7B-v0.1", 10000.0, 32768, 4096),  # v0.1: known window
    ("Mistral-7B-Instruct-v0.2", 1e6, 32768, None),  # later versions: full attention
    ("Llama-2-7b", 10000.0, 4096, None),
])
def test_mistral_gguf_window(tmp_path, name, theta, context, window):
    path = str(tmp_path / f"{name}.gguf")
    _write(path, "llama", {**LLAMA, "context": context, "theta": theta}, _llama_weights(), name=name)
    cfg = ModelConfig.from_dir(resolve_model(path, cache_dir=str(tmp_path / "cache")))
    assert cfg.layer_window(0) == window
    assert cfg.architecture == ("MistralForCausalLM" if window else "LlamaForCausalLM")


def test_phi3_longrope_gguf_greedy_matches_hf(tmp_path):
    """As llama.cpp writes Phi-3: fused attn_qkv and ffn_up (gate then up), rotary dims as
    rope.dimension_count, longrope factors as rope_factors_long/short tensors."""
    from test_model_families import _ours

    from tests.harness.tiny_families import LONGROPE, family_config, randomize

    cfg = family_config("phi3_longrope", vocab_size=len(TOKENS))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(hf, 5)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    c = dict(layers=cfg.num_hidden_layers, context=cfg.max_position_embeddings, hidden=cfg.hidden_size,
             inter=cfg.intermediate_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
             head_dim=head_dim, theta=10000.0)

    def extra(w):
        w.add_rope_dimension_count(head_dim // 2)
        w.add_rope_scaling_orig_ctx_len(LONGROPE["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(LONGROPE["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(LONGROPE["short_factor"], dtype=np.float32))

    path = str(tmp_path / "Tiny-Phi3.gguf")
    _write(path, "phi3", c, {n: p.detach().numpy() for n, p in hf.state_dict().items()}, extra=extra)
    out = resolve_model(path, cache_dir=str(tmp_path / "cache"))
    ours = ModelConfig.from_dir(out)
    assert (ours.architecture, ours.rotary_dim, ours.rope_scaling["rope_type"]) == ("Phi3ForCausalLM", 16, "longrope")
    prompt = list(range(3, 43))  # 40 tokens: past original_max_position_embeddings (30) throughout
    with torch.no_grad():
        want = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert _ours(out, "float32", [prompt]) == [want]
