"""Our loader + CausalLM must reproduce HF transformers' logits (float32), for a full-prompt
forward and for chunked prefill + batched decode over scattered KV pages."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve.core.envs import Envs  # noqa: E402
from pdserve.engine.attention import AttnBatch  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.model_files import resolve_model  # noqa: E402

PAGE = 4
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**TINY, rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "llama_linear": lambda: transformers.LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1e6),
    "mistral": lambda: transformers.MistralConfig(**TINY, rope_theta=1e6, sliding_window=None),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF's init is too small to make a mismatch visible; use O(1) activations instead."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(our model, HF model) on the same random weights, saved and reloaded through safetensors."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[request.param](), attn_implementation="eager", dtype=torch.float32)
    _randomize(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours, cfg = load_model(str(path), torch.float32, "cpu")
    return ours, hf.eval(), cfg


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _pages(pages: list[int], n: int) -> list[int]:
    """The first pages of a hand-picked, scattered page list that hold n tokens."""
    return pages[:(n + PAGE - 1) // PAGE]


def _pool(cfg, pages: int = 32) -> KVPool:
    return KVPool(cfg.num_layers, pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32)


def test_full_prompt_forward_matches_hf(tiny):
    ours, hf, cfg = tiny
    ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    pages = _pages([9, 2, 5, 11, 0, 7, 3, 14, 6, 1], len(ids))
    batch = AttnBatch.build([len(ids)], [len(ids)], [pages], PAGE)
    hidden = ours(torch.tensor(ids), torch.arange(len(ids)), batch, _pool(cfg))
    logits = ours.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), cfg.vocab_size)
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_batched_decode_match_hf(tiny):
    """Two sequences on interleaved pages: prefill chunks and 1-token decodes in mixed steps."""
    ours, hf, cfg = tiny
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (30, 21)]
    refs = [_hf_logits(hf, s) for s in seqs]
    pages = [[3, 12, 7, 0, 9, 15, 4, 10], [1, 8, 14, 5, 11, 2]]
    pool = _pool(cfg)
    done = [0, 0]
    # (tokens added to A, tokens added to B) per step: prefill, mixed chunk + decode, then decodes
    plan = [(20, 9), (1, 5), *[(1, 1)] * 7, *[(1, 0)] * 2]
    for add in plan:
        rows = [i for i in (0, 1) if add[i]]
        ids, pos = [], []
        for i in rows:
            ids += seqs[i][done[i]:done[i] + add[i]]
            pos += range(done[i], done[i] + add[i])
        seq_lens = [done[i] + add[i] for i in rows]
        batch = AttnBatch.build(seq_lens, [add[i] for i in rows],
                                [_pages(pages[i], n) for i, n in zip(rows, seq_lens)], PAGE)
        logits = ours.logits(ours(torch.tensor(ids), torch.tensor(pos), batch, pool))
        start = 0
        for i in rows:
            got = logits[start:start + add[i]]
            torch.testing.assert_close(got, refs[i][done[i]:done[i] + add[i]], atol=1e-4, rtol=1e-4)
            start += add[i]
            done[i] += add[i]
    assert done == [30, 21]


def test_fingerprint_and_eos(tiny):
    _, _, cfg = tiny
    fp = cfg.fingerprint()
    assert {k: fp[k] for k in ("architecture", "num_layers", "num_kv_heads", "head_dim", "layer_windows")} == {
        "architecture": cfg.architecture, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
        "layer_windows": [None, None]}
    assert fp["rope"][:2] == [cfg.rope_theta, cfg.rope_scaling]
    assert cfg.eos_token_ids == (2,)
    assert cfg.qkv_bias == (cfg.architecture == "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def default_model():
    path = resolve_model("", Envs.read().cache_dir)
    ours, cfg = load_model(path, torch.float32, "cpu", max_positions=512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return ours, hf.eval(), cfg, tok


def test_default_model_matches_hf(default_model):
    ours, hf, cfg, tok = default_model
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    n = len(ids)
    batch = AttnBatch.build([n], [n], [list(range((n + PAGE - 1) // PAGE))], PAGE)
    pool = KVPool(cfg.num_layers, (n + PAGE - 1) // PAGE, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    got = ours.logits(ours(torch.tensor(ids), torch.arange(n), batch, pool))
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(got, ref, atol=5e-4, rtol=1e-4)
    assert tok.decode(int(ref[-1].argmax())).strip() == "The"  # the weights are the real model's


def test_default_model_greedy_decode_matches_hf_generate(default_model):
    ours, hf, cfg, tok = default_model
    ids = tok("Paris is the capital of")["input_ids"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):]
    pages = [5, 2, 7, 0]  # page size 4 -> room for 16 tokens
    pool = KVPool(cfg.num_layers, 8, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    got: list[int] = []
    new = ids
    for _ in range(8):
        n = len(ids) + len(got)
        batch = AttnBatch.build([n], [len(new)], [_pages(pages, n)], PAGE)
        hidden = ours(torch.tensor(new), torch.arange(n - len(new), n), batch, pool)
        got.append(int(ours.logits(hidden[-1:]).argmax(-1)))
        new = got[-1:]
    assert got == want.tolist(), (tok.decode(got), tok.decode(want))


def test_default_model_bfloat16_close_to_float32(default_model):
    ours32, _, cfg, tok = default_model
    path = resolve_model("smollm2-135m", Envs.read().cache_dir)
    ours16, _ = load_model(path, torch.bfloat16, "cpu", max_positions=512)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    n = len(ids)
    outs = []
    for model, dtype in ((ours32, torch.float32), (ours16, torch.bfloat16)):
        pool = KVPool(cfg.num_layers, n, 1, cfg.num_kv_heads, cfg.head_dim, dtype)
        batch = AttnBatch.build([n], [n], [list(range(n))], 1)
        outs.append(model.logits(model(torch.tensor(ids), torch.arange(n), batch, pool)))
    assert outs[1].dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1)
    assert cos.min() > 0.98, cos.min()
    agree = (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean()
    assert agree > 0.8, agree
