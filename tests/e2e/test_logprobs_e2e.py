"""Top logprobs and echo end to end with the official `openai` client (tiny model), on a
colocated server and through the PD router (prefill + decode): chat top_logprobs, completions
logprobs=k, SGLang's top_logprobs_num, streamed and not; echo with max_tokens=0 (what
lm-eval-harness's loglikelihood sends) gives a null then one logprob per prompt token; under
greedy the PD answer equals the colocated one, alternatives included."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fault_tools import Router  # noqa: E402
from shared_servers import COLOCATED, DECODE, PREFILL, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "p": PREFILL, "d": DECODE}

TEXT = "of once upon a time"
MSGS = [{"role": "user", "content": TEXT}]
K = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(shared_servers):
    return shared_servers.model_dir


@pytest.fixture(scope="module")
def cluster(shared_servers, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("logprobs"))
    with borrow(shared_servers, LENT) as servers:
        router = Router([servers["p"]], [servers["d"]], log_dir=logs).wait_healthy()
        try:
            model = httpx.get(servers["colo"].url + "/v1/models", timeout=10).json()["data"][0]["id"]
            yield {**servers, "router": router, "model": model}
        finally:
            router.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    from pdserve.server.tokenizer import ServerTokenizer
    return ServerTokenizer.from_dir(model_dir)


def client(cluster, where: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster[where].url + "/v1", api_key="none", max_retries=0, timeout=60)


def assert_alts_close(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> None:
    """Same alternatives: values equal within TOL, tokens equal wherever no near-tie can swap them."""
    assert len(a) == len(b)
    for (ta, va), (tb, vb) in zip(a, b):
        assert va == pytest.approx(vb, abs=TOL)
    clear = lambda alts: {t for t, v in alts if v > alts[-1][1] + 1e-3}  # noqa: E731
    assert clear(a) == clear(b)


def assert_sorted_top(tops: list[tuple[str, float]], token: str, lp: float) -> None:
    vals = [v for _, v in tops]
    assert vals == sorted(vals, reverse=True)
    assert tops[0] == (token, lp)  # greedy: the chosen token is the most likely, with the same logprob


# ---- chat -------------------------------------------------------------------------------------

def chat_logprobs(cluster, where: str, stream: bool) -> list:
    """[(token, logprob, [(alt token, alt logprob)] x K)] of a greedy chat answer."""
    kw = dict(model=cluster["model"], messages=MSGS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=K)
    c = client(cluster, where)
    if not stream:
        r = c.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
    else:
        content = []
        for chunk in c.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content.extend(chunk.choices[0].logprobs.content or [])
    out = []
    for e in content:
        assert e.bytes == list(e.token.encode("utf-8")) and len(e.top_logprobs) == K
        assert all(a.bytes == list(a.token.encode("utf-8")) for a in e.top_logprobs)
        out.append((e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]))
    return out


def assert_same_answers(a: list, b: list) -> None:
    assert [x[0] for x in a] == [x[0] for x in b]
    for (_, la, ta), (_, lb, tb) in zip(a, b):
        assert la == pytest.approx(lb, abs=TOL)
        assert_alts_close(ta, tb)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_colocated_and_through_the_pd_router(cluster, stream):
    colo = chat_logprobs(cluster, "colo", stream)
    assert len(colo) >= 2
    for token, lp, tops in colo:
        assert_sorted_top(tops, token, lp)
    assert_same_answers(chat_logprobs(cluster, "router", stream), colo)
    if stream:
        assert_same_answers(colo, chat_logprobs(cluster, "colo", False))


# ---- completions ------------------------------------------------------------------------------

def completion(cluster, where: str, stream: bool, **kw) -> tuple[str, dict, int | None]:
    """(text, logprobs as a dict of lists, completion tokens) of a greedy completion."""
    args = dict(model=cluster["model"], temperature=0, **kw)
    c = client(cluster, where)
    if not stream:
        r = c.completions.create(**args)
        lp = r.choices[0].logprobs
        lps = None if lp is None else {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                                       "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}
        return r.choices[0].text, lps, r.usage.completion_tokens
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        text += chunk.choices[0].text
        lp = chunk.choices[0].logprobs
        if lp is not None:
            for key in lps:
                lps[key].extend(getattr(lp, key) or [])
    return text, lps, None


def dict_alts(top: dict) -> list[tuple[str, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])


def assert_same_completion(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    la, lb = a[1], b[1]
    assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
    for x, y in zip(la["token_logprobs"], lb["token_logprobs"]):
        assert (x is None and y is None) or x == pytest.approx(y, abs=TOL)
    for x, y in zip(la["top_logprobs"], lb["top_logprobs"]):
        assert (x is None and y is None) or assert_alts_close(dict_alts(x), dict_alts(y)) is None


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_k_colocated_and_through_the_pd_router(cluster, stream):
    colo = completion(cluster, "colo", stream, prompt=TEXT, max_tokens=6, logprobs=4)
    text, lps, _ = colo
    assert len(lps["tokens"]) == 6 and text  # (a byte-level token's text need not be valid UTF-8 alone)
    for token, lp, top in zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"]):
        # the k best and the chosen (tokens sharing a text, such as byte pieces, share an entry)
        assert 1 <= len(top) <= 5 and top[token] == lp and max(top.values()) == lp
    assert_same_completion(completion(cluster, "router", stream, prompt=TEXT, max_tokens=6, logprobs=4), colo)
    if stream:
        assert_same_completion(colo, completion(cluster, "colo", False, prompt=TEXT, max_tokens=6, logprobs=4))


def test_echo_with_max_tokens_0_gives_the_prompt_logprobs(cluster, tok):
    """lm-eval-harness's loglikelihood request: token-id prompt, echo, logprobs=1, max_tokens=0.
    One entry per prompt token, the first null; the values are /generate's input logprobs; the
    second identical request (prompt now cached) is computed again, not taken from the cache."""
    ids = tok.encode(TEXT)
    req = dict(prompt=ids, echo=True, logprobs=1, max_tokens=0)
    colo = completion(cluster, "colo", False, **req)
    text, lps, n_out = colo
    assert n_out == 0 and text == tok.decode(ids, skip_special_tokens=False)
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == len(ids)
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["text_offset"][0] == 0 and "".join(lps["tokens"]) == text
    native = httpx.post(cluster["colo"].url + "/generate", timeout=60, json={
        "input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    want = [e[0] for e in native["meta_info"]["input_token_logprobs"]]
    assert want[0] is None and lps["token_logprobs"][1:] == pytest.approx(want[1:], abs=TOL)
    for token, lp, top in zip(lps["tokens"][1:], lps["token_logprobs"][1:], lps["top_logprobs"][1:]):
        assert top[token] == lp and 1 <= len(top) <= 2
    r = client(cluster, "colo").completions.create(model=cluster["model"], temperature=0, **req)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert_same_completion(completion(cluster, "colo", False, **req), colo)
    assert_same_completion(completion(cluster, "router", False, **req), colo)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_output_tokens(cluster, tok, stream):
    """echo + generation: the prompt text then the output, prompt logprobs then output logprobs
    (text offsets continue), through the router exactly as colocated."""
    n = len(tok.encode(TEXT))
    colo = completion(cluster, "colo", stream, prompt=TEXT, echo=True, logprobs=2, max_tokens=3)
    text, lps, _ = colo
    assert text.startswith(TEXT) and len(lps["tokens"]) == n + 3 and lps["token_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lps["token_logprobs"][1:])
    assert lps["text_offset"][n] == len(TEXT)
    assert_same_completion(completion(cluster, "router", stream, prompt=TEXT, echo=True, logprobs=2, max_tokens=3),
                           colo)
    plain = completion(cluster, "colo", stream, prompt=TEXT, echo=True, max_tokens=3)  # no logprobs
    assert plain[0] == text and not (plain[1] or {}).get("tokens")


# ---- SGLang /generate -------------------------------------------------------------------------

def generate(cluster, where: str, stream: bool) -> dict:
    body = {"text": TEXT, "return_logprob": True, "top_logprobs_num": K, "stream": stream,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    r = httpx.post(cluster[where].url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["meta_info"]
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return events[-1]["meta_info"]


def native_alts(entries: list) -> list[tuple[int, float]]:
    return [(tid, lp) for lp, tid, _ in entries]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_top_logprobs_num(cluster, tok, stream):
    colo = generate(cluster, "colo", stream)
    out, tops = colo["output_token_logprobs"], colo["output_top_logprobs"]
    assert len(out) == len(tops) == 5
    for (lp, tid, _), top in zip(out, tops):
        assert len(top) == K and top[0][:2] == [lp, tid]
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
    n = len(tok.encode(TEXT))
    assert len(colo["input_top_logprobs"]) == n and colo["input_top_logprobs"][0] is None
    assert all(len(t) == K for t in colo["input_top_logprobs"][1:])
    pd = generate(cluster, "router", stream)
    assert [e[1] for e in pd["output_token_logprobs"]] == [e[1] for e in out]
    for a, b in zip(pd["output_top_logprobs"], tops):
        assert_alts_close(native_alts(a), native_alts(b))
    if not stream:  # the router puts the prefill's input logprobs in front (streams carry none)
        assert len(pd["input_top_logprobs"]) == n and pd["input_top_logprobs"][0] is None
        for a, b in zip(pd["input_top_logprobs"][1:], colo["input_top_logprobs"][1:]):
            assert_alts_close(native_alts(a), native_alts(b))


def test_servers_idle_after(cluster):
    for s in ("colo", "p", "d"):
        cluster[s].wait_idle()
