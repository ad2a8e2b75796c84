"""Sampling fields end to end on real servers (tiny model): penalties, logit_bias and min_tokens
change greedy output exactly as a plain reference says (HF generate with a one-loop logits
processor of the formulas) on /generate, /v1/completions and /v1/chat/completions; a PD pair
(prefill + decode) answers exactly what the colocated server does for each field; and every
field this server does not implement gets a 400 naming it, on every route it belongs to."""

from __future__ import annotations

import math
import random
from collections import Counter

import httpx
import pytest
from cluster import Server, pd_body, post_both, run  # noqa: E402
from shared_servers import COLOCATED, DECODE, PREFILL, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "p": PREFILL, "d": DECODE}
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EOS = 2
N = 16
# prompts picked for this tiny model (each case asserts that it changes the plain output):
TEXT = "of once"  # penalties of at most 2 (logits here spread ~9) change its greedy continuation
EOS_TEXT = "emoji dog"  # its plain greedy continuation is EOS at once
MSGS = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def model_dir(shared_servers):
    return shared_servers.model_dir


@pytest.fixture(scope="module")
def servers(shared_servers):
    with borrow(shared_servers, LENT) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir):
    from pdserve.server.tokenizer import ServerTokenizer
    return ServerTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # stop on EOS only when `reference` says so
    return m


class Formulas(transformers.LogitsProcessor):
    """The fields' definitions, one token at a time: logit_bias added, EOS masked while fewer
    than min_tokens were generated, repetition over prompt + generated (> 0 divided, else
    multiplied), frequency * count + presence * [count > 0] over the generated tokens."""

    def __init__(self, prompt_len: int, f: dict):
        self.n, self.f = prompt_len, f

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b in range(scores.shape[0]):
            seq = input_ids[b].tolist()
            gen = seq[self.n:]
            row = scores[b]
            for t, bias in (self.f.get("logit_bias") or {}).items():
                row[int(t)] += bias
            if len(gen) < self.f.get("min_tokens", 0):
                row[EOS] = -math.inf
            rp = self.f.get("repetition_penalty", 1.0)
            for t in set(seq):
                row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
            for t, c in Counter(gen).items():
                row[t] -= self.f.get("frequency_penalty", 0.0) * c + self.f.get("presence_penalty", 0.0)
        return scores


def reference(hf, prompt: list[int], fields: dict, ignore_eos: bool = False) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, pad_token_id=0,
                          eos_token_id=None if ignore_eos else EOS,
                          logits_processor=transformers.LogitsProcessorList([Formulas(len(prompt), fields)]))
    return out[0, len(prompt):].tolist()


def native_fields(fields: dict) -> dict:
    """OpenAI / vLLM names -> SGLang sampling_params names."""
    return {("min_new_tokens" if k == "min_tokens" else k): v for k, v in fields.items()}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def route_body(route: str, tok, fields: dict, ignore_eos: bool, prompt_text: str) -> tuple[dict, list[int]]:
    """(body, prompt ids) for `route` with the fields under their names there."""
    if route == "/generate":
        sp = {"max_new_tokens": N, "temperature": 0, "ignore_eos": ignore_eos, **native_fields(fields)}
        return {"text": prompt_text, "sampling_params": sp}, tok.encode(prompt_text)
    common = {"max_tokens": N, "temperature": 0, "ignore_eos": ignore_eos, **fields}
    if route == "/v1/completions":
        ids = tok.encode(prompt_text)
        return {"prompt": ids, **common}, ids
    return {"messages": MSGS, **common}, tok.encode_chat(MSGS)


def output_of(route: str, r: httpx.Response):
    """What the route reveals of the output: ids on /generate, (text, token count) on /v1."""
    assert r.status_code == 200, r.text
    j = r.json()
    if route == "/generate":
        return j["output_ids"]
    c = j["choices"][0]
    return (c["text"] if route == "/v1/completions" else c["message"]["content"], j["usage"]["completion_tokens"])


def expect(route: str, tok, ids: list[int]):
    return ids if route == "/generate" else (tok.decode(ids), len(ids))


def field_cases(plain_first: int) -> dict[str, tuple[dict, bool, str]]:
    """name -> (fields in OpenAI names, ignore_eos, prompt text); `plain_first` is the first
    token of the route's plain greedy answer to TEXT."""
    return {
        "logit_bias_forbids": ({"logit_bias": {str(plain_first): -100}}, True, TEXT),
        "logit_bias_forces": ({"logit_bias": {"300": 100}}, True, TEXT),
        "frequency_penalty": ({"frequency_penalty": 2.0}, True, TEXT),
        "presence_penalty": ({"presence_penalty": 2.0}, True, TEXT),
        "negative_penalties": ({"frequency_penalty": -1.0, "presence_penalty": -0.5}, True, TEXT),
        "repetition_penalty": ({"repetition_penalty": 1.6}, True, TEXT),
        "min_tokens": ({"min_tokens": 5}, False, EOS_TEXT),  # the plain answer is EOS at once
        "min_tokens_vs_biased_eos": ({"min_tokens": 4, "logit_bias": {str(EOS): 50}}, False, TEXT),
    }


ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]
ROUTE_CASES = [(r, c) for r in ROUTES for c in field_cases(0)
               if not (c == "min_tokens" and r == "/v1/chat/completions")]  # chat's prompt: no early EOS


def plain_first(route: str, tok, hf) -> int:
    return reference(hf, route_body(route, tok, {}, True, TEXT)[1], {}, ignore_eos=True)[0]


@pytest.mark.parametrize("route, case", ROUTE_CASES)
def test_field_changes_greedy_output_as_the_reference_says(servers, tok, hf, route, case):
    fields, ignore_eos, text = field_cases(plain_first(route, tok, hf))[case]
    body, prompt = route_body(route, tok, fields, ignore_eos, text)
    want = reference(hf, prompt, fields, ignore_eos)
    plain = reference(hf, prompt, {}, ignore_eos)
    assert want != plain, f"{case} does not change the greedy output here: the case tests nothing"
    if case == "min_tokens":
        assert plain == [EOS] and len(want) > 5 and EOS not in want[:5]
    assert output_of(route, post(servers["colo"], route, body)) == expect(route, tok, want)
    if case == "min_tokens_vs_biased_eos":  # the bias alone ends at once; min_tokens holds EOS back 4 tokens
        bias_only = {"logit_bias": fields["logit_bias"]}
        assert reference(hf, prompt, bias_only) == [EOS]
        assert output_of(route, post(servers["colo"], route, route_body(route, tok, bias_only, False, text)[0])) == \
            expect(route, tok, [EOS])
        assert len(want) == 5 and want[-1] == EOS and EOS not in want[:4]
    # a plain request next to it is untouched (no state leaks between requests)
    plain_body, _ = route_body(route, tok, {}, ignore_eos, text)
    assert output_of(route, post(servers["colo"], route, plain_body)) == expect(route, tok, plain)


@pytest.mark.parametrize("route", ROUTES)
def test_pd_equals_colocated_for_each_field(servers, tok, hf, route):
    """The prefill samples the first token with the fields (its prompt counts for
    repetition_penalty, no generated tokens yet); the decode continues from it with counts
    that include it. Greedy: the decode's answer is exactly the colocated one."""
    P, D, C = servers["p"], servers["d"], servers["colo"]
    for case, (fields, ignore_eos, text) in field_cases(plain_first(route, tok, hf)).items():
        body, _ = route_body(route, tok, fields, ignore_eos, text)
        want = output_of(route, post(C, route, body))
        rp, rd = run(post_both(P, D, pd_body(body, P, random.getrandbits(63)), path=route))
        assert rp.status_code == 200, (case, rp.text)
        assert output_of(route, rd) == want, case
    P.wait_idle()
    D.wait_idle()


# ---- refused fields ---------------------------------------------------------------------------

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
BOTH = (COMP, CHAT)
REFUSED = [  # (routes, extra fields, what the 400 names)
    # structured outputs work (tests/e2e/test_structured_outputs_e2e.py) except structural tags
    (BOTH, {"response_format": {"type": "structural_tag"}}, "structural_tag"),
    # tools / tool_choice: tests/e2e/test_tools_e2e.py, tests/unit/test_tools_api.py
    ((CHAT,), {"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ((COMP,), {"suffix": "!"}, "suffix"),
    (BOTH, {"best_of": 2}, "best_of"),
    (BOTH, {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
    (BOTH, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    (("/generate",), {"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
]
BASE = {"/generate": {"text": "hi"}, COMP: {"prompt": "hi", "max_tokens": 4}, CHAT: {"messages": MSGS, "max_tokens": 4}}


def refused_cases():
    for routes, extra, field in REFUSED:
        for r in routes:
            yield pytest.param(r, extra, field, id=f"{r}-{field}-{len(str(extra))}")


def assert_refused(r: httpx.Response, field: str, what: str = "is not supported by this server") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and what in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("route, extra, field", list(refused_cases()))
def test_unsupported_field_is_a_400_naming_it(servers, route, extra, field):
    assert_refused(post(servers["colo"], route, {**BASE[route], **extra}), field)


def test_refusals_on_both_pd_legs_and_bad_values(servers, model_dir):
    """The PD legs refuse the same way (same front), an out-of-vocabulary logit_bias id is
    refused by the engine on every route and on both legs, and nothing is left in flight."""
    P, D, C = servers["p"], servers["d"], servers["colo"]
    body = pd_body({"prompt": "hi", "max_tokens": 4, "response_format": {"type": "structural_tag"}}, P,
                   random.getrandbits(63))
    rp, rd = run(post_both(P, D, body, path=COMP))
    assert_refused(rp, "structural_tag")
    assert_refused(rd, "structural_tag")
    vocab = C.info()["vocab_size"]
    big = {str(vocab): 1.0}
    for route, b in ((COMP, {"logit_bias": big}), (CHAT, {"logit_bias": big}),
                     ("/generate", {"sampling_params": {"logit_bias": big}})):
        assert_refused(post(C, route, {**BASE[route], **b}), "logit_bias", "outside the vocabulary")
    body = pd_body({"text": "hi", "sampling_params": {"max_new_tokens": 4, "logit_bias": big}}, P,
                   random.getrandbits(63))
    rp, rd = run(post_both(P, D, body))
    assert_refused(rp, "logit_bias", "outside the vocabulary")
    assert_refused(rd, "logit_bias", "outside the vocabulary")
    for route, b, field in ((COMP, {"presence_penalty": 2.5}, "presence_penalty"),
                            (CHAT, {"frequency_penalty": -3}, "frequency_penalty"),
                            (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
                            (COMP, {"logit_bias": {"5": 200}}, "logit_bias"),
                            (COMP, {"logit_bias": {"five": 1}}, "logit_bias"),
                            (CHAT, {"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
                            ("/generate", {"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}},
                             "min_new_tokens"),
                            ("/generate", {"sampling_params": {"repetition_penalty": -1}}, "repetition_penalty")):
        r = post(C, route, {**{k: v for k, v in BASE[route].items() if k != "max_tokens"}, **b})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (route, b, r.text)
    # the no-op spellings of refused fields are served
    ok = post(C, CHAT, {**BASE[CHAT], "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                        "logprobs": True, "top_logprobs": 0, "best_of": 1})
    assert ok.status_code == 200, ok.text
    ok = post(C, COMP, {**BASE[COMP], "logprobs": 0, "echo": False, "suffix": None})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["token_logprobs"]) >= 1, ok.text
    for s in (P, D, C):
        s.wait_idle()
