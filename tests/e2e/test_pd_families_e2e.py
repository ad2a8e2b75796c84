"""PD disaggregation for a newer family: a tiny Gemma 3 (sliding-window and full layers with
their own RoPE, q/k norms, Gemma norms) through real prefill and decode servers gives the
colocated server's greedy tokens, for prompts and outputs past the window."""

from __future__ import annotations

import random

import httpx
import pytest
from cluster import Server, pd_body, post_both, run, stop_all  # noqa: E402
from tiny_families import make_tiny_family  # noqa: E402

pytestmark = pytest.mark.e2e

PROMPTS = ["Once upon a time, in a land far away, there lived", "a b c d e f g h i j k l m n o p"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = make_tiny_family(str(tmp_path_factory.mktemp("gemma3")), "gemma3")
    logs = str(tmp_path_factory.mktemp("logs"))
    s = {"colo": Server("colocated", model_dir, log_dir=logs),
         "p": Server("prefill", model_dir, log_dir=logs),
         "d": Server("decode", model_dir, log_dir=logs)}
    try:
        for srv in s.values():
            srv.wait_ready()
        yield s
    finally:
        stop_all(list(s.values()))


def test_gemma3_pd_equals_colocated(servers):
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    for prompt in PROMPTS:
        r = httpx.post(servers["colo"].url + "/generate", json={"text": prompt, "sampling_params": sampling},
                       timeout=60)
        assert r.status_code == 200, r.text
        want = r.json()["output_ids"]
        assert len(want) == 24
        body = pd_body({"text": prompt, "sampling_params": sampling}, servers["p"], random.getrandbits(63))
        rp, rd = run(post_both(servers["p"], servers["d"], body))
        assert rp.status_code == 200, rp.text
        assert rd.status_code == 200, rd.text
        assert rd.json()["output_ids"] == want, prompt
        assert rd.json()["meta_info"]["kv_bytes"] > 0
    for srv in servers.values():
        srv.wait_idle()
