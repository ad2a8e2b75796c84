"""Tests of the serving benchmark: metrics, arrivals and datasets as pure units, then whole
runs against tests/harness/stub_openai_server.py (a subprocess on a free 127.0.0.1 port)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import urllib.request
from dataclasses import fields
from pathlib import Path

import pytest

from pdserve.bench.arrivals import ArrivalKind, arrival_offsets
from pdserve.bench.backends import (
    BackendOptions,
    OpenAIChatBackend,
    OpenAICompletionsBackend,
    PDServeBackend,
    StreamState,
)
from pdserve.bench.conversations import make_conversations, turn_request
from pdserve.bench.datasets import WORDS, TokenCounter, file_requests, random_requests, shared_prefix_requests
from pdserve.bench.metrics import RequestRecord, format_summary, parse_slo, percentile, stats_ms, summarize
from pdserve.bench.serve import BenchConfig, BenchError, build_bench_parser, load_conversations, run, run_bench
from pdserve.core.launcher import ProcessGroup, free_port

STUB = Path(__file__).resolve().parents[1] / "harness" / "stub_openai_server.py"
START_DEADLINE_S = 30.0


# ---------------------------------------------------------------- the stub server
@pytest.fixture(scope="module")
def stub_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("stub") / "stub.log"
    with ProcessGroup([sys.executable, str(STUB)], name="openai stub", log_path=str(log)) as stub:
        port = int(stub.wait_output(r"READY (\d+)", START_DEADLINE_S).group(1))
        yield f"http://127.0.0.1:{port}"


def _http(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def configure(url: str, **cfg) -> None:
    """Set the stub's config (unnamed fields back to defaults) and reset its stats."""
    defaults = {"ttft": 0.0, "token_delay": 0.0, "error_rate": 0.0, "error_mode": "http",
                "tokens_per_chunk": 1, "report_usage": True, "eos_after": 0,
                "report_cached": False, "tag_answers": False, "fail_marker": ""}
    _http(url + "/_stub/config", {**defaults, **cfg})


def stub_stats(url: str) -> dict:
    return _http(url + "/_stub/stats")


def bench(url: str, **kw) -> BenchConfig:
    base = dict(url=url, num_prompts=8, random_input_len=12, random_output_len=5,
                warmup_requests=0, disable_tqdm=True, request_timeout=30.0)
    if kw.get("dataset") in ("shared-prefix", "multi-turn"):
        del base["num_prompts"]  # their own flags set the count
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
    dead = f"http://127.0.0.1:{free_port()}"  # free a moment ago: nothing listens there
    res = asyncio.run(run(bench(dead, num_prompts=3)))
    assert res.summary.failed == 3 and "ClientConnectorError" in res.summary.errors[0]
    with pytest.raises(BenchError, match="warmup request"):
        asyncio.run(run(bench(dead, num_prompts=3, warmup_requests=1)))


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
                 ["--num-prompts", "0"], ["--dataset", "shared-prefix", "--num-prompts", "5"],
                 ["--dataset", "multi-turn", "--multi-turn-turns", "0"]):
        assert run_bench(build_bench_parser().parse_args(argv + ["--disable-tqdm"])) == 2
        assert "error:" in capsys.readouterr().err


# ---------------------------------------------------------------- prefix-cache workloads (pure)
def _common_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split()):
        if x != y:
            break
        n += 1
    return n


def test_shared_prefix_prompts_share_exactly_their_prefix():
    n_pre, n_suf, p_len, s_len = 3, 5, 20, 6
    reqs = shared_prefix_requests(n_pre, n_suf, p_len, s_len, 4, seed=2, counter=TokenCounter())
    assert len(reqs) == 15 and len({r.prompt for r in reqs}) == 15
    assert all(r.prompt_len == 26 == len(r.prompt.split()) and r.output_len == 4 for r in reqs)
    assert all(w in WORDS for r in reqs for w in r.prompt.split())
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(" ".join(r.prompt.split()[:p_len]), []).append(i)
    assert sorted(len(g) for g in groups.values()) == [n_suf] * n_pre
    for i, a in enumerate(reqs):
        for j, b in enumerate(reqs[:i]):
            same = any(i in g and j in g for g in groups.values())
            # Same prefix: shared exactly up to the suffix; different prefixes: not a first word.
            assert _common_words(a.prompt, b.prompt) == (p_len if same else 0)
    suffixes = [" ".join(r.prompt.split()[p_len:]) for r in reqs]
    assert len(set(suffixes)) == 15
    # Interleaved: no prefix's requests are sent back to back as one block.
    assert all(g[-1] - g[0] > n_suf - 1 for g in groups.values())
    assert reqs == shared_prefix_requests(n_pre, n_suf, p_len, s_len, 4, 2, TokenCounter())
    other = shared_prefix_requests(n_pre, n_suf, p_len, s_len, 4, 3, TokenCounter())
    assert [r.prompt for r in other] != [r.prompt for r in reqs]
    with pytest.raises(ValueError, match="distinct"):  # 200 one-word suffixes cannot all differ
        shared_prefix_requests(2, 200, 5, 1, 4, 0, TokenCounter())


def _byte_level_tokenizer(path: Path) -> Path:
    """A small byte-level BPE (GPT-2 / Llama-3 style), so words split into several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def test_shared_prefix_lengths_with_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_byte_level_tokenizer(tmp_path)))
    counter = TokenCounter(str(tmp_path))
    p_len, s_len = 40, 9
    reqs = shared_prefix_requests(4, 6, p_len, s_len, 3, seed=1, counter=counter)
    ids = [tok.encode(r.prompt, add_special_tokens=False).ids for r in reqs]
    assert sum(len(r.prompt.split()) for r in reqs) < 24 * (p_len + s_len)  # tokens, not words
    for r, t in zip(reqs, ids):
        assert r.prompt_len == len(t) == p_len + s_len
    heads: dict[tuple, int] = {}
    for t in ids:  # the first p_len tokens are the prefix, the same for exactly 6 prompts
        heads[tuple(t[:p_len])] = heads.get(tuple(t[:p_len]), 0) + 1
    assert sorted(heads.values()) == [6] * 4
    assert len({tuple(t) for t in ids}) == 24


def test_cache_dataset_flags_and_request_counts():
    args = build_bench_parser().parse_args([
        "--dataset", "shared-prefix", "--prefix-num-prefixes", "3", "--prefix-suffixes-per-prefix",
        "2", "--prefix-len", "50", "--suffix-len", "7"])
    cfg = BenchConfig(**{k: getattr(args, k) for k in ("dataset", "prefix_num_prefixes",
                                                        "prefix_suffixes_per_prefix", "prefix_len",
                                                        "suffix_len")})
    assert (cfg.prefix_len, cfg.suffix_len, cfg.planned_requests()) == (50, 7, 6)
    assert BenchConfig(dataset="shared-prefix", prefix_num_prefixes=3, prefix_suffixes_per_prefix=2,
                       num_prompts=6).planned_requests() == 6
    with pytest.raises(ValueError, match="disagrees"):
        BenchConfig(dataset="shared-prefix", prefix_num_prefixes=3, prefix_suffixes_per_prefix=2,
                    num_prompts=7)
    mt = BenchConfig(dataset="multi-turn", multi_turn_conversations=5, multi_turn_turns=3)
    assert mt.planned_requests() == 15 and BenchConfig(num_prompts=7).planned_requests() == 7
    with pytest.raises(ValueError, match="disagrees"):
        BenchConfig(dataset="multi-turn", multi_turn_conversations=5, multi_turn_turns=3, num_prompts=10)
    with pytest.raises(ValueError, match="multi-turn-first-len"):
        BenchConfig(dataset="multi-turn", multi_turn_first_len=0)


def test_multi_turn_requests_carry_the_history():
    convs = make_conversations(3, 4, 12, 5, 6, seed=4, counter=TokenCounter())
    assert convs == make_conversations(3, 4, 12, 5, 6, seed=4, counter=TokenCounter())
    assert [len(c.questions) for c in convs] == [4, 4, 4] and all(c.output_len == 6 for c in convs)
    assert [len(q.split()) for q in convs[0].questions] == [12, 5, 5, 5]
    assert len({c.questions[0].split()[0] for c in convs}) == 3  # no two chats share a prefix
    c = convs[1]
    first = turn_request(c, [], TokenCounter())
    assert first.prompt == f"User: {c.questions[0]}\nAssistant:"
    assert [(m.role, m.content) for m in first.messages] == [("user", c.questions[0])]
    third = turn_request(c, [" ans one", " ans two"], TokenCounter())
    assert [(m.role, m.content) for m in third.messages] == [
        ("user", c.questions[0]), ("assistant", " ans one"), ("user", c.questions[1]),
        ("assistant", " ans two"), ("user", c.questions[2])]
    assert third.prompt == (f"User: {c.questions[0]}\nAssistant: ans one\nUser: {c.questions[1]}"
                            f"\nAssistant: ans two\nUser: {c.questions[2]}\nAssistant:")
    second = turn_request(c, [" ans one"], TokenCounter())
    assert third.prompt.startswith(second.prompt + " ans two\n")  # the cacheable prefix
    assert third.prompt_len == len(third.prompt.split()) and third.output_len == 6
    opts = BackendOptions(model="m")
    chat = OpenAIChatBackend().payload(third, opts)["messages"]
    assert chat == [{"role": m.role, "content": m.content} for m in third.messages]
    assert OpenAICompletionsBackend().payload(third, opts)["prompt"] == third.prompt
    assert PDServeBackend().payload(third, opts)["text"] == third.prompt
    assert OpenAIChatBackend().payload(random_requests(1, 3, 2, 1.0, 0, TokenCounter())[0],
                                       opts)["messages"][0]["role"] == "user"


def test_backends_parse_cached_tokens():
    pd = PDServeBackend()
    assert pd.parse({"text": "a", "meta_info": {"cached_tokens": 7}}, StreamState()).cached_tokens == 7
    assert pd.parse({"text": "a", "meta_info": {"cached_tokens": 0}}, StreamState()).cached_tokens == 0
    assert pd.parse({"text": "a", "meta_info": {}}, StreamState()).cached_tokens is None
    comp = OpenAICompletionsBackend()
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
    assert comp.parse({"choices": [], "usage": usage}, StreamState()).cached_tokens == 4
    for usage in ({"prompt_tokens": 9}, {"prompt_tokens_details": None},
                  {"prompt_tokens_details": {"cached_tokens": "x"}}):
        assert comp.parse({"choices": [], "usage": usage}, StreamState()).cached_tokens is None


def test_summary_cache_fields_count_unknown_apart_from_zero():
    def rec(i, cached, server=None, ok=True):
        r = _rec(i, ok=ok, err="" if ok else "boom")
        r.cached_tokens, r.server_prompt_tokens = cached, server
        return r

    recs = [rec(0, 30, server=40), rec(1, 0, server=60), rec(2, None, server=50), rec(3, 10),
            rec(4, 99, server=99, ok=False)]
    s = summarize(recs, 1.0, {})
    assert s.total_prompt_tokens == 40 + 60 + 50 + 20  # the server's count, else prompt_len (20)
    assert (s.cached_requests, s.total_cached_tokens) == (3, 40)
    assert s.mean_cached_tokens == pytest.approx(40 / 3)
    assert s.cache_hit_rate == pytest.approx(40 / (40 + 60 + 20))
    text = format_summary(s)
    assert "Prefix cache hit rate:" in text and "33.3%" in text and "3/4" in text
    zero = summarize([rec(0, 0, server=40)], 1.0, {})
    assert (zero.total_cached_tokens, zero.cache_hit_rate) == (0, 0.0)
    unknown = summarize([rec(0, None, server=40)], 1.0, {})
    assert unknown.total_cached_tokens is None and unknown.cache_hit_rate is None
    assert unknown.mean_cached_tokens is None and unknown.cached_requests == 0
    na_rows = [ln for ln in format_summary(unknown).splitlines() if "cache" in ln.lower()]
    assert len(na_rows) == 3 and all(ln.endswith("n/a") for ln in na_rows)


# ---------------------------------------------------------------- prefix-cache workloads (stub)
@pytest.mark.parametrize("backend", ["pdserve", "openai-completions", "openai-chat"])
def test_shared_prefix_run_reports_cache_hits(stub_url, backend, tmp_path):
    configure(stub_url, report_cached=True)
    out = tmp_path / "r.json"
    cfg = bench(stub_url, backend=backend, dataset="shared-prefix", prefix_num_prefixes=2,
                prefix_suffixes_per_prefix=3, prefix_len=10, suffix_len=3, random_output_len=2,
                max_concurrency=1, warmup_requests=1, output=str(out))
    res = asyncio.run(run(cfg))
    s = res.summary
    assert (s.num_requests, s.completed) == (6, 6)
    st = stub_stats(stub_url)
    reported = st["cached"][1:]  # body 0 is the warmup
    assert [r.cached_tokens for r in res.records] == reported
    seen: set[str] = set()
    for r, body in zip(res.records, st["bodies"][1:]):
        text = body.get("text") or body.get("prompt") or body["messages"][0]["content"]
        prefix = " ".join(text.split()[:10])
        # A hit covers the whole prefix exactly when an earlier request had it; the warmup did not.
        assert (r.cached_tokens >= 10) == (prefix in seen)
        seen.add(prefix)
    assert len(seen) == 2
    assert (s.total_prompt_tokens, s.cached_requests, s.total_cached_tokens) == (78, 6, sum(reported))
    assert s.cache_hit_rate == pytest.approx(sum(reported) / 78) and s.cache_hit_rate > 0.4
    assert f"{100 * s.cache_hit_rate:.1f}%" in format_summary(s)
    saved = json.loads(out.read_text())
    assert saved["summary"]["total_cached_tokens"] == sum(reported)
    assert saved["summary"]["cache_hit_rate"] == pytest.approx(s.cache_hit_rate)
    assert [r["cached_tokens"] for r in saved["requests"]] == reported


def test_flush_cache_empties_the_servers_cache_after_warmup(stub_url):
    """--flush-cache: the warmup's prompt is forgotten before timing (vLLM's route as fallback)."""
    configure(stub_url, report_cached=True)
    cfg = bench(stub_url, dataset="shared-prefix", prefix_num_prefixes=1, prefix_suffixes_per_prefix=2,
                prefix_len=10, suffix_len=3, random_output_len=2, max_concurrency=1, warmup_requests=1,
                flush_cache=True)
    res = asyncio.run(run(cfg))
    st = stub_stats(stub_url)
    assert st["flushes"] == 1  # /flush_cache is a 404 on the stub: it fell back to vLLM's route
    assert res.records[0].cached_tokens == 0 and res.records[1].cached_tokens >= 10


def test_missing_cached_tokens_are_unknown_not_zero(stub_url):
    configure(stub_url)  # usage reported, cached tokens not
    res = asyncio.run(run(bench(stub_url, backend="openai-chat", num_prompts=3)))
    s = res.summary
    assert all(r.cached_tokens is None and r.server_prompt_tokens == 12 for r in res.records)
    assert (s.total_prompt_tokens, s.cached_requests, s.total_cached_tokens) == (36, 0, None)
    assert s.cache_hit_rate is None and "n/a" in format_summary(s)


def test_multi_turn_system_prompt_is_shared_and_first():
    plain = make_conversations(3, 3, 12, 5, 6, seed=4, counter=TokenCounter())
    convs = make_conversations(3, 3, 12, 5, 6, seed=4, counter=TokenCounter(), system_len=20)
    assert [c.questions for c in convs] == [c.questions for c in plain]  # same messages as without
    assert all(c.system == convs[0].system for c in convs) and len(convs[0].system.split()) == 20
    assert plain[0].system == ""
    firsts = [turn_request(c, [], TokenCounter()) for c in convs]
    assert {f.prompt.split("\nUser: ")[0] for f in firsts} == {f"System: {convs[0].system}"}
    c = convs[1]
    second = turn_request(c, [" ans"], TokenCounter())
    assert second.prompt == (f"System: {c.system}\nUser: {c.questions[0]}\nAssistant: ans\n"
                             f"User: {c.questions[1]}\nAssistant:")
    assert second.prompt.startswith(firsts[1].prompt + " ans\n")
    assert [m.role for m in second.messages] == ["system", "user", "assistant", "user"]
    assert OpenAIChatBackend().payload(second, BackendOptions(model="m"))["messages"][0] == {
        "role": "system", "content": c.system}
    cfg = BenchConfig(dataset="multi-turn", multi_turn_conversations=3, multi_turn_turns=3,
                      multi_turn_first_len=12, multi_turn_question_len=5, random_output_len=6,
                      multi_turn_system_len=20, seed=4)
    assert load_conversations(cfg, TokenCounter()) == convs
    with pytest.raises(ValueError, match="multi-turn-system-len"):
        BenchConfig(dataset="multi-turn", multi_turn_system_len=-1)


def _conv_turn(body: dict, convs) -> tuple[int, int]:
    """Which (conversation, turn) a multi-turn request body is, from its first user message."""
    if "messages" in body:
        first, turn = body["messages"][0]["content"], (len(body["messages"]) - 1) // 2
    else:
        text = body.get("text", body.get("prompt"))
        first, turn = text.split("\nAssistant:")[0].removeprefix("User: "), text.count("User: ") - 1
    return next(c.index for c in convs if c.questions[0] == first), turn


@pytest.mark.parametrize("backend", ["pdserve", "openai-completions", "openai-chat"])
def test_multi_turn_run_resends_every_answer(stub_url, backend):
    configure(stub_url, tag_answers=True, ttft=0.03, token_delay=0.002)
    cfg = bench(stub_url, backend=backend, dataset="multi-turn", multi_turn_conversations=3,
                multi_turn_turns=3, multi_turn_first_len=8, multi_turn_question_len=4,
                random_output_len=3)
    res = asyncio.run(run(cfg))
    convs = load_conversations(cfg, TokenCounter())
    st = stub_stats(stub_url)
    where = {_conv_turn(b, convs): i for i, b in enumerate(st["bodies"])}
    assert sorted(where) == [(c, t) for c in range(3) for t in range(3)] and len(st["bodies"]) == 9
    for (c, t), i in where.items():
        qs = convs[c].questions
        answers = [st["answers"][where[c, j]] for j in range(t)]
        assert all(a.startswith(f"r{where[c, j]}.0 ") for j, a in enumerate(answers))  # tagged
        body = st["bodies"][i]
        if backend == "openai-chat":
            expected = []
            for q, a in zip(qs, answers):
                expected += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            assert body["messages"] == expected + [{"role": "user", "content": qs[t]}]
        else:
            text = "".join(f"User: {q}\nAssistant:{a}\n" for q, a in zip(qs, answers))
            assert body.get("text", body.get("prompt")) == text + f"User: {qs[t]}\nAssistant:"
        if t:  # turns of a conversation never overlap: sent after the last reply ended
            assert st["arrivals"][i] >= st["ends"][where[c, t - 1]]
    assert st["max_inflight"] == 3  # while the conversations ran side by side
    s = res.summary
    assert (s.num_requests, s.completed, s.failed, s.not_sent) == (9, 9, 0, 0)
    recs = {(r.conversation, r.turn): r for r in res.records}
    assert sorted(recs) == sorted(where)
    for (c, t), r in recs.items():
        assert r.index == 3 * c + t
        if t:
            prev = recs[c, t - 1]
            assert r.prompt_len > prev.prompt_len
            assert r.send_time >= prev.send_time + prev.e2e - 1e-3
            assert r.scheduled_time >= prev.send_time + prev.e2e - 1e-3


def test_multi_turn_failed_turn_ends_its_conversation(stub_url):
    cfg = bench(stub_url, backend="openai-chat", dataset="multi-turn", multi_turn_conversations=3,
                multi_turn_turns=4, multi_turn_first_len=8, multi_turn_question_len=4,
                random_output_len=2, max_concurrency=2)
    convs = load_conversations(cfg, TokenCounter())
    configure(stub_url, ttft=0.02, fail_marker=convs[1].questions[1])
    res = asyncio.run(run(cfg))
    s = res.summary
    assert (s.num_requests, s.completed, s.failed, s.not_sent) == (10, 9, 1, 2)
    turns = {c: [r.turn for r in res.records if r.conversation == c] for c in range(3)}
    assert turns == {0: [0, 1, 2, 3], 1: [0, 1], 2: [0, 1, 2, 3]}
    failed = [r for r in res.records if not r.success]
    assert [(r.conversation, r.turn) for r in failed] == [(1, 1)]
    assert s.errors == ["HTTP 500: stub injected failure (x1)"]
    assert "Turns not sent (conversation ended):" in format_summary(s)
    st = stub_stats(stub_url)
    assert len(st["bodies"]) == 10 and st["max_inflight"] == 2 and s.max_concurrency_seen == 2
    where = {_conv_turn(b, convs): i for i, b in enumerate(st["bodies"])}
    # A conversation holds its slot to its last turn: the third starts only once one has ended.
    ended = min(st["ends"][where[0, 3]], st["arrivals"][where[1, 1]])
    assert st["arrivals"][where[2, 0]] >= ended


def test_multi_turn_rate_schedules_conversation_starts(stub_url):
    configure(stub_url, token_delay=0.01)
    rate = 10.0
    res = asyncio.run(run(bench(stub_url, dataset="multi-turn", multi_turn_conversations=3,
                                multi_turn_turns=2, multi_turn_first_len=6,
                                multi_turn_question_len=3, random_output_len=4,
                                request_rate=rate, arrival="fixed")))
    firsts = sorted((r for r in res.records if r.turn == 0), key=lambda r: r.conversation)
    assert [r.scheduled_time for r in firsts] == pytest.approx([0.0, 0.1, 0.2])
    assert all(r.send_time >= r.scheduled_time - 1e-3 for r in firsts)
    arrivals = sorted(stub_stats(stub_url)["arrivals"])
    assert len(arrivals) == 6 and arrivals[-1] - arrivals[0] >= 0.2


def test_cli_runs_the_cache_datasets(stub_url, tmp_path, capsys):
    configure(stub_url, report_cached=True)
    out = tmp_path / "mt.json"
    argv = ["--url", stub_url, "--backend", "openai-completions", "--dataset", "multi-turn",
            "--multi-turn-conversations", "2", "--multi-turn-turns", "3", "--multi-turn-first-len",
            "10", "--multi-turn-question-len", "3", "--random-output-len", "2",
            "--warmup-requests", "0", "--disable-tqdm", "--output", str(out)]
    assert run_bench(build_bench_parser().parse_args(argv)) == 0
    printed = capsys.readouterr().out
    assert "Prefix cache hit rate:" in printed and "n/a" not in printed
    data = json.loads(out.read_text())
    assert data["summary"]["not_sent"] == 0 and data["summary"]["completed"] == 6
    assert sorted((r["conversation"], r["turn"]) for r in data["requests"]) == [
        (c, t) for c in range(2) for t in range(3)]
    later = [r for r in data["requests"] if r["turn"]]
    assert all(r["cached_tokens"] > 10 for r in later)  # each resends the previous turn
