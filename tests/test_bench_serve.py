"""Tests of the serving benchmark: metrics, arrivals and datasets as pure units, then whole
runs against tests/stub_openai_server.py (a subprocess on a free 127.0.0.1 port)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import select
import subprocess
import sys
import urllib.request
from dataclasses import fields
from pathlib import Path

import pytest

from pdserve.bench.arrivals import ArrivalKind, arrival_offsets
from pdserve.bench.backends import (OpenAIChatBackend, OpenAICompletionsBackend, PDServeBackend,
                                    StreamState)
from pdserve.bench.datasets import WORDS, TokenCounter, file_requests, random_requests
from pdserve.bench.metrics import (RequestRecord, format_summary, parse_slo, percentile, stats_ms,
                                   summarize)
from pdserve.bench.serve import BenchConfig, BenchError, build_bench_parser, run, run_bench

STUB = Path(__file__).with_name("stub_openai_server.py")
START_DEADLINE_S = 30.0


# ---------------------------------------------------------------- the stub server
@pytest.fixture(scope="module")
def stub_url():
    proc = subprocess.Popen([sys.executable, str(STUB)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_DEADLINE_S)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("READY "), f"stub did not start within {START_DEADLINE_S}s: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        os.kill(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, 9)
            proc.wait(timeout=10)
        proc.stdout.close()


def _http(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def configure(url: str, **cfg) -> None:
    """Set the stub's config (unnamed fields back to defaults) and reset its stats."""
    defaults = {"ttft": 0.0, "token_delay": 0.0, "error_rate": 0.0, "error_mode": "http",
                "tokens_per_chunk": 1, "report_usage": True, "eos_after": 0}
    _http(url + "/_stub/config", {**defaults, **cfg})


def stub_stats(url: str) -> dict:
    return _http(url + "/_stub/stats")


def bench(url: str, **kw) -> BenchConfig:
    base = dict(url=url, num_prompts=8, random_input_len=12, random_output_len=5,
                warmup_requests=0, disable_tqdm=True, request_timeout=30.0)
    return BenchConfig(**{**base, **kw})


# ---------------------------------------------------------------- metrics (pure)
def test_percentiles_on_known_inputs():
    xs = [float(i) for i in range(1, 11)]
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile(list(reversed(xs)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    s = stats_ms([0.001, 0.002, 0.003, 0.010])
    assert (s.count, s.mean, s.median, s.min, s.max) == (4, pytest.approx(4.0), pytest.approx(2.5), 1.0, 10.0)
    assert s.p90 == pytest.approx(7.9) and s.p99 == pytest.approx(9.79)
    with pytest.raises(ValueError):
        percentile(xs, 101)


def _rec(i, ok=True, ttft=0.1, e2e=1.0, out=10, itl=(0.1,), err=""):
    return RequestRecord(index=i, prompt_len=20, output_len_requested=10, success=ok, error=err,
                         output_len=out if ok else 0, ttft=ttft, e2e=e2e, itl=list(itl))


def test_summary_counts_failures_throughput_and_goodput():
    recs = [_rec(0, ttft=0.1, e2e=1.0), _rec(1, ttft=0.3, e2e=1.2, out=9),
            _rec(2, ok=False, err="HTTP 500: boom"), _rec(3, ok=False, err="HTTP 500: boom"),
            _rec(4, ok=False, err="timeout")]
    assert recs[0].tpot == pytest.approx(0.1) and recs[2].tpot is None
    s = summarize(recs, duration_s=2.0, slo=parse_slo("ttft_ms=200,tpot_ms=150"), max_concurrency_seen=3)
    assert (s.num_requests, s.completed, s.failed) == (5, 2, 3)
    assert (s.total_input_tokens, s.total_output_tokens) == (40, 19)
    assert s.request_throughput == pytest.approx(1.0) and s.output_throughput == pytest.approx(9.5)
    assert s.goodput == pytest.approx(0.5)  # only request 0 meets ttft <= 200 ms
    assert s.output_len_mismatches == 1
    assert s.errors == ["HTTP 500: boom (x2)", "timeout (x1)"]
    assert s.latency_ms["ttft"].mean == pytest.approx(200.0)
    assert s.latency_ms["itl"].count == 2
    text = format_summary(s)
    assert "Failed requests:" in text and "HTTP 500: boom (x2)" in text and "goodput" in text
    assert summarize(recs, 2.0, {}).goodput is None


def test_parse_slo_rejects_bad_input():
    assert parse_slo("") == {}
    assert parse_slo("ttft_ms=500, e2e_ms=2000") == {"ttft_ms": 500.0, "e2e_ms": 2000.0}
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=fast", "tpot_ms=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


# ---------------------------------------------------------------- arrivals and datasets (pure)
def test_arrival_schedules():
    assert arrival_offsets(4, math.inf, ArrivalKind.POISSON, 0) == [0.0] * 4
    assert arrival_offsets(4, 2.0, ArrivalKind.FIXED, 0) == [0.0, 0.5, 1.0, 1.5]
    a = arrival_offsets(2000, 10.0, ArrivalKind.POISSON, 7)
    assert a == arrival_offsets(2000, 10.0, ArrivalKind.POISSON, 7)
    assert a != arrival_offsets(2000, 10.0, ArrivalKind.POISSON, 8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, ArrivalKind.FIXED, 0)


def test_random_prompts_have_asked_lengths_and_are_seeded():
    words = TokenCounter()
    reqs = random_requests(20, 30, 7, 1.0, seed=3, counter=words)
    assert all(r.prompt_len == 30 == len(r.prompt.split()) and r.output_len == 7 for r in reqs)
    assert all(w in WORDS for r in reqs for w in r.prompt.split())
    assert reqs == random_requests(20, 30, 7, 1.0, seed=3, counter=words)
    assert len({r.prompt for r in reqs}) == 20
    ranged = random_requests(200, 40, 10, 0.5, seed=1, counter=words)
    assert all(20 <= r.prompt_len <= 40 and 5 <= r.output_len <= 10 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 5


def test_random_prompts_counted_with_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # A small vocabulary, so many words split into several tokens.
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainers.BpeTrainer(vocab_size=120,
                                                                         special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter(str(tmp_path))
    assert counter.exact
    reqs = random_requests(20, 50, 4, 1.0, seed=5, counter=counter)
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False).ids)
        assert abs(r.prompt_len - 50) <= 2
    assert sum(len(r.prompt.split()) for r in reqs) < 20 * 50  # tokens, not words
    with pytest.raises(FileNotFoundError):
        TokenCounter(str(tmp_path / "missing"))


def test_file_datasets_sharegpt_and_prompt_records(tmp_path):
    share = [
        {"conversations": [{"from": "human", "value": "hello there friend"},
                           {"from": "gpt", "value": "one two three four"}]},
        {"conversations": [{"role": "user", "content": "what time is it"},
                           {"role": "assistant", "content": "noon"}]},
        {"conversations": [{"from": "human", "value": "a prompt with no answer"}]},
        {"unrelated": 1},
    ]
    p = tmp_path / "share.json"
    p.write_text(json.dumps(share))
    reqs = sorted(file_requests(str(p), 10, 0, TokenCounter()), key=lambda r: r.prompt)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("hello there friend", 3, 4), ("what time is it", 4, 1)]
    assert all(r.output_len == 9 for r in file_requests(str(p), 10, 0, TokenCounter(), 9))
    assert len(file_requests(str(p), 1, 0, TokenCounter())) == 1
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "say hi", "output_len": 6}\n\n{"prompt": "x", "output_len": 0}\n')
    assert [(r.prompt, r.output_len) for r in file_requests(str(jl), 5, 0, TokenCounter())] == [("say hi", 6)]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "no length"}\n')
    with pytest.raises(ValueError, match="no usable prompts"):
        file_requests(str(empty), 5, 0, TokenCounter())


# ---------------------------------------------------------------- stream parsing (pure)
def test_backends_parse_their_streams():
    st = StreamState()
    pd = PDServeBackend()
    ev = pd.parse({"text": "ab", "meta_info": {"completion_tokens": 1, "prompt_tokens": 4}}, st)
    assert (ev.text, ev.content, ev.completion_tokens, ev.prompt_tokens) == ("ab", True, 1, 4)
    st.text, st.completion_tokens = "ab", 1
    ev = pd.parse({"text": "abcd", "meta_info": {"completion_tokens": 2}}, st)
    assert (ev.text, ev.content) == ("cd", True)
    ev = pd.parse({"text": "ab", "meta_info": {"completion_tokens": 2}}, st)  # token held back
    assert (ev.text, ev.content) == ("", True)
    ev = pd.parse({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "gone"}}}, st)
    assert ev.error == "aborted: gone"

    chat = OpenAIChatBackend()
    assert not chat.parse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, StreamState()).content
    assert chat.parse({"choices": [{"delta": {"content": "hi"}}]}, StreamState()).text == "hi"
    usage = chat.parse({"choices": [], "usage": {"completion_tokens": 5, "prompt_tokens": 3}}, StreamState())
    assert (usage.content, usage.completion_tokens, usage.prompt_tokens) == (False, 5, 3)
    comp = OpenAICompletionsBackend()
    assert comp.parse({"choices": [{"text": "x", "finish_reason": None}]}, StreamState()).text == "x"
    assert comp.parse({"error": {"message": "bad"}}, StreamState()).error == "bad"


# ---------------------------------------------------------------- whole runs against the stub
@pytest.mark.parametrize("backend", ["pdserve", "openai-completions", "openai-chat"])
def test_three_backends_stream_and_time(stub_url, backend):
    configure(stub_url, ttft=0.02, token_delay=0.005, tokens_per_chunk=2)
    res = asyncio.run(run(bench(stub_url, backend=backend, num_prompts=6, warmup_requests=1)))
    s = res.summary
    assert (s.completed, s.failed, s.output_len_mismatches) == (6, 0, 0)
    assert s.total_output_tokens == 30  # from usage / meta_info, not from the 3 chunks
    for r in res.records:
        assert r.output_len == 5 and r.chunks == 3 and len(r.itl) == 2
        assert 0 < r.ttft <= r.e2e and r.tpot == pytest.approx((r.e2e - r.ttft) / 4)
    st = stub_stats(stub_url)
    assert len(st["bodies"]) == 7  # warmup + 6
    for body in st["bodies"]:
        assert body["stream"] is True
        if backend == "pdserve":
            assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        else:
            assert body["model"] == "stub-model"  # found through /v1/models
            assert body["max_tokens"] == 5 and body["ignore_eos"] is True
            assert body["stream_options"] == {"include_usage": True}
            assert ("messages" in body) == (backend == "openai-chat")


@pytest.mark.parametrize("backend", ["pdserve", "openai-chat"])
def test_token_count_falls_back_to_chunks_without_usage(stub_url, backend):
    configure(stub_url, report_usage=False)
    res = asyncio.run(run(bench(stub_url, backend=backend, num_prompts=3)))
    assert [r.output_len for r in res.records] == [5, 5, 5]


def test_fixed_rate_is_obeyed_at_the_server(stub_url):
    configure(stub_url)
    rate, n = 20.0, 15
    res = asyncio.run(run(bench(stub_url, num_prompts=n, request_rate=rate, arrival="fixed")))
    arrivals = stub_stats(stub_url)["arrivals"]
    assert res.summary.completed == n and len(arrivals) == n
    mean_gap = (arrivals[-1] - arrivals[0]) / (n - 1)
    assert 0.9 / rate <= mean_gap <= 2.0 / rate
    assert [r.scheduled_time for r in res.records] == pytest.approx([i / rate for i in range(n)])


def test_poisson_rate_follows_the_seeded_schedule(stub_url):
    configure(stub_url)
    rate, n = 25.0, 25
    res = asyncio.run(run(bench(stub_url, num_prompts=n, request_rate=rate, seed=11)))
    expected = arrival_offsets(n, rate, ArrivalKind.POISSON, 11)
    arrivals = sorted(stub_stats(stub_url)["arrivals"])
    span = arrivals[-1] - arrivals[0]
    assert 0.9 * expected[-1] <= span <= expected[-1] + 0.5
    assert all(r.send_time >= r.scheduled_time - 1e-3 for r in res.records)


def test_max_concurrency_is_obeyed_at_the_server(stub_url):
    configure(stub_url, ttft=0.2, token_delay=0.01)
    res = asyncio.run(run(bench(stub_url, num_prompts=12, max_concurrency=3)))
    assert res.summary.completed == 12
    assert stub_stats(stub_url)["max_inflight"] == 3
    assert res.summary.max_concurrency_seen == 3


@pytest.mark.parametrize("mode,message", [("http", "HTTP 500: stub injected failure"),
                                          ("stream", "stream error: stub injected stream error")])
def test_failed_requests_are_counted_and_reported(stub_url, mode, message):
    configure(stub_url, error_rate=0.25, error_mode=mode)
    res = asyncio.run(run(bench(stub_url, backend="openai-completions", num_prompts=12,
                                max_concurrency=1)))
    s = res.summary
    assert (s.num_requests, s.completed, s.failed) == (12, 9, 3)
    assert len(res.records) == 12 and [r.index for r in res.records] == list(range(12))
    assert [r.index for r in res.records if not r.success] == [3, 7, 11]
    assert s.errors == [f"{message} (x3)"]
    assert message in format_summary(s)


def test_timeouts_and_unreachable_servers_fail_requests_not_the_run(stub_url):
    configure(stub_url, ttft=2.0)
    res = asyncio.run(run(bench(stub_url, num_prompts=2, request_timeout=0.3)))
    assert res.summary.failed == 2 and res.summary.errors[0].startswith("timeout")
    with socket_closed_port() as port:
        dead = f"http://127.0.0.1:{port}"
        res = asyncio.run(run(bench(dead, num_prompts=3)))
        assert res.summary.failed == 3 and "ClientConnectorError" in res.summary.errors[0]
        with pytest.raises(BenchError, match="warmup request"):
            asyncio.run(run(bench(dead, num_prompts=3, warmup_requests=1)))


class socket_closed_port:
    """A port that was free a moment ago and has nothing listening."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None


def test_ignore_eos_off_shows_short_outputs(stub_url):
    configure(stub_url, eos_after=2)
    res = asyncio.run(run(bench(stub_url, num_prompts=3, disable_ignore_eos=True)))
    assert res.summary.output_len_mismatches == 3 and all(r.output_len == 2 for r in res.records)


def test_cli_writes_complete_json(stub_url, tmp_path, capsys):
    configure(stub_url, token_delay=0.002, error_rate=0.2)
    out = tmp_path / "result.json"
    args = build_bench_parser().parse_args([
        "--url", stub_url, "--backend", "openai-chat", "--num-prompts", "10", "--max-concurrency", "1",
        "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "inf",
        "--slo", "ttft_ms=60000,tpot_ms=60000", "--warmup-requests", "0", "--disable-tqdm",
        "--api-key", "secret",
        "--output", str(out)])
    assert run_bench(args) == 1  # some requests failed
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "Mean TTFT (ms):" in printed and "P99 ITL" in printed

    def no_nan(name):
        raise AssertionError(f"non-JSON constant {name}")

    data = json.loads(out.read_text(), parse_constant=no_nan)
    assert set(data) == {"config", "model", "summary", "requests"}
    assert data["model"] == "stub-model" and data["config"]["api_key"] == "<redacted>"
    assert set(data["config"]) == {f.name for f in fields(BenchConfig)}
    assert data["config"]["backend"] == "openai-chat" and data["config"]["request_rate"] == "inf"
    summ = data["summary"]
    assert (summ["num_requests"], summ["completed"], summ["failed"]) == (10, 8, 2)
    assert summ["goodput"] == pytest.approx(summ["request_throughput"])
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert set(summ["latency_ms"][key]) >= {"mean", "median", "p90", "p99"}
    assert len(data["requests"]) == 10
    for r in data["requests"]:
        assert set(r) >= {"index", "success", "error", "prompt_len", "output_len", "ttft", "tpot",
                          "itl", "e2e", "send_time", "scheduled_time"}
        assert r["success"] == (r["error"] == "")


def test_cli_rejects_bad_config(capsys):
    for argv in (["--slo", "fast=1"], ["--dataset", "file"], ["--extra-body", "[1]"],
                 ["--num-prompts", "0"]):
        assert run_bench(build_bench_parser().parse_args(argv + ["--disable-tqdm"])) == 2
        assert "error:" in capsys.readouterr().err
