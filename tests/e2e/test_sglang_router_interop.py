"""Interop: sglang-router 0.3.2 (the router users already run) in front of pdserve prefill/decode
servers answers like the colocated server under greedy sampling. Skipped if it is not installed.

sglang-router probes /health, /server_info and /model_info and wants a local `model_path`; it
mints the rooms and sends the same body to both legs, with no DP rank of its own.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

from pdserve.core.launcher import LaunchError, ProcessGroup, free_port
from tests.harness.cluster import (  # noqa: E402
    ROOT,
    GenerateProbe,
    Server,
)
from tests.harness.shared_servers import COLOCATED, DECODE, PREFILL_DP2, borrow  # noqa: E402

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "p": PREFILL_DP2, "d": DECODE}

GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPTS = ["Hello world", "The capital of France is"]
CHAT = {"model": "tiny", "max_tokens": 10, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


class SglangRouter:
    """`python -m sglang_router.launch_router --pd-disaggregation ...` in its own process group."""

    def __init__(self, prefill: Server, decode: Server, log_dir: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
               "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warn"]
        self.log_path = os.path.join(log_dir, f"sglang-router-{self.port}.log")
        self.group = ProcessGroup(cmd, name="sglang-router", log_path=self.log_path, cwd=ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 90.0) -> "SglangRouter":
        """Until a /generate goes through (it adds the workers after its own start-up checks)."""
        serves = GenerateProbe(self.url)
        try:
            self.group.wait_healthy(serves, timeout, what="serving /generate", poll_s=0.3)
        except LaunchError as e:
            raise RuntimeError(f"{e}\n(last answer: {serves.last})") from None
        return self

    def tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def stop(self) -> None:
        self.group.stop(grace_s=10.0)


@pytest.fixture(scope="module")
def interop(shared_servers, tmp_path_factory):
    """(colocated, prefill dp 2, decode dp 1, sglang-router), all serving."""
    workdir = str(tmp_path_factory.mktemp("sglang_interop"))
    with borrow(shared_servers, LENT) as s:
        router = SglangRouter(s["p"], s["d"], workdir).wait_serving()
        try:
            yield s["colo"], s["p"], s["d"], router
        finally:
            router.stop()


def test_generate_through_sglang_router_equals_colocated(interop):
    colo, prefill, decode, router = interop
    for prompt in PROMPTS:
        ref = httpx.post(colo.url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60).json()
        r = httpx.post(router.url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
        assert out["meta_info"]["dp_rank_path"] in ("fast", "single")  # its room, our DP rules
    prefill.wait_idle()
    decode.wait_idle()


def test_chat_through_sglang_router_equals_colocated(interop):
    colo, prefill, decode, router = interop
    ref = httpx.post(colo.url + "/v1/chat/completions", json=CHAT, timeout=60).json()
    text = ref["choices"][0]["message"]["content"]
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text and text
    assert r.json()["usage"] == ref["usage"]
    s = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60)
    assert s.status_code == 200, s.text
    data = [ln[len("data: "):] for ln in s.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")) == text
    prefill.wait_idle()
    decode.wait_idle()
