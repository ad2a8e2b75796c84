"""The default model (SmolLM2-135M-Instruct, float32) through a real colocated server over HTTP:
greedy output equals HF transformers' `generate` on the same weights, token for token, for chat
prompts (with the model's chat template) and plain prompts of different lengths, sent at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

transformers = pytest.importorskip("transformers")

from pdserve.core.envs import Envs  # noqa: E402
from pdserve.model_files import resolve_model  # noqa: E402
from tests.harness.cluster import Server  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NEW = 24
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain step by step how photosynthesis turns light, water and carbon dioxide into sugar, "
    "and why the oxygen that plants release matters so much for animals that breathe it.",
]
PLAINS = [
    "The quick brown fox",
    "Paris is the capital of",
    "In the beginning of the twentieth century, the small fishing town on the northern coast was "
    "known for three things: its storms, its lighthouse, and the family who had kept that light "
    "burning for four generations. Every evening at dusk, the eldest daughter climbed the spiral "
    "stairs, trimmed the wick, polished the great lens and watched the sea. One winter night",
]


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("smollm2-135m", Envs.read().cache_dir)


@pytest.fixture(scope="module")
def server(model_path, request):
    # page size 4 and 64-token prefill chunks (cluster defaults): long prompts span several chunks
    s = Server("colocated", model_path, dp=1, extra=["--max-total-tokens", "4096"])
    request.addfinalizer(s.stop)
    return s.wait_ready(timeout=300)


@pytest.fixture(scope="module")
def hf(model_path):
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").eval()
    return tok, model


def hf_greedy(model, ids: list[int], eos: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def prompt_ids(tok) -> list[tuple[str, list[int]]]:
    chats = [("chat: " + c, tok.apply_chat_template([{"role": "user", "content": c}],
                                                     add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)) for c in CHATS]
    plains = [("plain: " + p, tok(p)["input_ids"]) for p in PLAINS]
    return chats + plains


async def _post_all(url: str, reqs: list[tuple[str, dict]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as c:
        resps = await asyncio.gather(*(c.post(url + path, json=body) for path, body in reqs))
    for r in resps:
        assert r.status_code == 200, r.text
    return [r.json() for r in resps]


def test_greedy_equals_hf_generate(server, hf):
    tok, model = hf
    eos = tok.eos_token_id
    cases = prompt_ids(tok)
    lengths = sorted(len(ids) for _, ids in cases)
    assert lengths[0] < 8 and lengths[-1] > 64  # short prompts and ones prefilled in several chunks
    sp = {"max_new_tokens": NEW, "temperature": 0.0}
    reqs = [("/generate", {"input_ids": ids, "sampling_params": sp}) for _, ids in cases]
    reqs += [("/v1/chat/completions", {"messages": [{"role": "user", "content": c}], "max_tokens": NEW,
                                       "temperature": 0}) for c in CHATS]
    reqs += [("/generate", {"text": p, "sampling_params": sp}) for p in PLAINS]
    replies = asyncio.run(_post_all(server.url, reqs))  # all at once: batched on one worker
    native, chat, by_text = replies[:len(cases)], replies[len(cases):len(cases) + len(CHATS)], \
        replies[len(cases) + len(CHATS):]
    for (name, ids), got in zip(cases, native):
        want = hf_greedy(model, ids, eos)
        assert got["output_ids"] == want, \
            f"{name}\n ours: {tok.decode(got['output_ids'])!r}\n   HF: {tok.decode(want)!r}"
        assert got["meta_info"]["finish_reason"]["type"] == ("stop" if want[-1] == eos else "length"), name
        assert got["meta_info"]["prompt_tokens"] == len(ids)
    for (name, ids), got, reply in zip(cases, native, chat):  # the server applies the same template
        assert reply["usage"]["prompt_tokens"] == len(ids), name
        text = tok.decode(got["output_ids"], skip_special_tokens=True)
        assert reply["choices"][0]["message"]["content"] == text, name
    for (name, ids), got, ref in zip(cases[len(CHATS):], by_text, native[len(CHATS):]):  # tokenized like HF
        assert got["meta_info"]["prompt_tokens"] == len(ids) and got["output_ids"] == ref["output_ids"], name
    assert any("Paris" in tok.decode(g["output_ids"]) for g in native[:1])  # real weights, real answer
    server.wait_idle()
