"""`pdserve bench up` end to end with a tiny model: it runs the shared-prefix multi-turn chats on
`pdserve up` and then on a colocated server, prints both rows and the ratios, writes the JSON,
and stops every process it started. Every process carries a marker in its environment, so the
checks (and the finalizer, by pid) find them all, workers included."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid

import pytest
from test_up import MARK, marked_pids, wait_for  # noqa: E402

from pdserve.bench.metrics import RequestRecord, summarize
from pdserve.bench.up_bench import (
    Run,
    SystemResult,
    combine,
    comparison,
    format_results,
    prometheus_counters,
    run_systems,
)
from tests.harness.cluster import ROOT  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def marked():
    """A marker token for the processes of one test; whatever carries it is killed at the end."""
    token = uuid.uuid4().hex
    yield token
    for pid in marked_pids(MARK, token):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_bench_up_runs_both_systems_and_leaves_nothing(tmp_path, marked):
    tiny = make_tiny_model(str(tmp_path / "tiny"), max_context=1024)
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "pdserve", "bench", "up", "--model", tiny, "--dtype", "float32",
           "--max-total-tokens", "2048", "--conversations", "3", "--turns", "2", "--system-len", "40",
           "--first-len", "20", "--question-len", "6", "--output-len", "4", "--max-concurrency", "2",
           "--up-args", "--prefill-dp 1 --decode-dp 2 --disagg-local-prefill-max-tokens 16",
           "--colocated-args", "--num-threads 1", "--start-timeout", "120", "--request-timeout", "60",
           "--log-dir", str(tmp_path / "logs"), "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT, MARK: marked})
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    text = proc.stdout
    assert "up (run 1, load average" in text and "colocated (run 1," in text, text
    assert "pdserve up --prefill-dp 1 --decode-dp 2" in text and "decode (dp 2" in text, text
    assert "pdserve serve --role colocated --num-threads 1" in text, text
    for row in ("up ", "colocated ", "up/colocated", "targets: mean TTFT <= 1.2x"):
        assert any(line.startswith(row) for line in text.splitlines()), (row, text)
    data = json.loads(out.read_text())
    for name in ("up", "colocated"):
        s = data["systems"][name]["summary"]
        assert (s["completed"], s["failed"]) == (6, 0), s
        assert s["total_cached_tokens"] > 0  # the system prompt and the history were reused
        assert 0 < data["systems"][name]["reused_pct"] < 100
        assert 6 <= s["latency_ms"]["itl"]["count"] <= 6 * 3  # 4 tokens: at most 3 gaps per turn
        assert len(data["systems"][name]["loadavg"]) == 1
    up = data["systems"]["up"]
    assert up["counters"]["local"] + up["counters"]["remote"] == 6  # the run's turns, no warm-up
    assert len(up["rank_pages"]["prefill"]) == 1 and len(up["rank_pages"]["decode"]) == 2
    cmp = data["up_vs_colocated"]
    assert set(cmp["targets_met"]) == {"mean_ttft", "itl_p99", "reused"} and cmp["mean_ttft"] > 0
    wait_for(lambda: not marked_pids(MARK, marked), 15, "every process of the bench to exit")


def test_bench_up_refuses_bad_flags_before_starting_anything(marked):
    for flags, why in ((["--systems", "up,vllm"], "--systems"), (["--systems", "up,up"], "each once"),
                       (["--repeats", "0"], "--repeats"), (["--conversations", "0"], ">= 1")):
        proc = subprocess.run([sys.executable, "-m", "pdserve", "bench", "up", "--model", "no-such-model", *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ROOT, MARK: marked})
        assert proc.returncode == 2 and why in proc.stderr, (flags, proc.stderr)
    assert not marked_pids(MARK, marked)


def _result(name: str, ttfts: list[float], gap: float, cached: int) -> SystemResult:
    recs = []
    for i, ttft in enumerate(ttfts):
        r = RequestRecord(index=i, prompt_len=100, output_len_requested=3, success=True, output_len=3,
                          cached_tokens=cached, ttft=ttft, e2e=ttft + 2 * gap, itl=[gap, gap], turn=i % 2)
        recs.append(r)
    s = summarize(recs, 10.0, {})
    return SystemResult(name, name, s, 0.0, 0.0)


def test_repeats_run_the_systems_in_a_b_b_a_order(capsys):
    order = []

    class Fake:
        def __init__(self, name):
            self.name, self.described = name, f"start {name}"

    def measure_one(system):
        order.append(system.name)
        rec = RequestRecord(index=0, prompt_len=10, output_len_requested=2, success=True, output_len=2,
                            ttft=0.1, e2e=0.2, itl=[0.1], turn=0)
        return Run([rec], 1.0, 1, {}, {}, (0.5, 0.5))

    results = run_systems(["up", "colocated"], 3, Fake, measure_one)
    assert order == ["up", "colocated", "colocated", "up", "up", "colocated"]
    assert [(r.name, r.summary.completed, len(r.loadavg)) for r in results] == [("up", 3, 3), ("colocated", 3, 3)]
    assert "colocated (run 2, load average 0.5 -> 0.5): start colocated" in capsys.readouterr().out


def test_runs_of_a_system_combine_into_one_result():
    def rec(i, turn, ttft):
        return RequestRecord(index=i, prompt_len=10, output_len_requested=2, success=True, output_len=2,
                             cached_tokens=5, ttft=ttft, e2e=ttft + 0.1, itl=[0.1], turn=turn)
    runs = [Run([rec(0, 0, 0.4), rec(1, 1, 0.2)], 2.0, 2, {"local": 1.0}, {"decode": [1, 2]}, (1.0, 2.0)),
            Run([rec(0, 0, 0.6), rec(1, 1, 0.2)], 2.0, 1, {"local": 1.0, "remote": 1.0}, {"decode": [3, 4]},
                (2.0, 3.0))]
    r = combine("up", "cmd", runs)
    assert (r.summary.completed, r.summary.duration_s, r.summary.max_concurrency_seen) == (4, 4.0, 2)
    assert r.summary.output_throughput == pytest.approx(8 / 4.0) and r.reused_pct == pytest.approx(50.0)
    assert (r.ttft_first_turn_ms, r.ttft_later_turns_ms) == (pytest.approx(500.0), pytest.approx(200.0))
    assert r.counters == {"local": 2.0, "remote": 1.0} and r.rank_pages == {"decode": [3, 4]}
    assert r.loadavg == [(1.0, 2.0), (2.0, 3.0)]


def test_comparison_ratios_and_targets():
    up, colo = _result("up", [0.2, 0.4], 0.01, 60), _result("colocated", [0.2, 0.2], 0.02, 65)
    cmp = comparison(up, colo)
    assert cmp["mean_ttft"] == pytest.approx(1.5) and cmp["itl_p99"] == pytest.approx(0.5)
    assert cmp["reused_points"] == pytest.approx(-5.0) and cmp["output_throughput"] == pytest.approx(1.0)
    assert cmp["targets_met"] == {"mean_ttft": False, "itl_p99": True, "reused": True}
    text = format_results([up, colo], cmp)
    assert "1.50x (NOT met)" in text and "0.50x (met)" in text and "-5.0 (met)" in text
    no_cache = _result("colocated", [0.2], 0.02, 0)
    no_cache.summary.cache_hit_rate = None
    assert math.isnan(comparison(up, no_cache)["reused_points"])


def test_prometheus_counters_sums_matching_samples():
    text = ('# HELP pdserve_disagg_decisions_total x\n'
            'pdserve_disagg_decisions_total{role="decode",decision="local"} 3.0\n'
            'pdserve_disagg_decisions_total{decision="remote",role="decode"} 5\n'
            'pdserve_disagg_decisions_total{role="prefill",decision="dropped"} 3.0\n')
    got = prometheus_counters(text, {
        "local": ("pdserve_disagg_decisions_total", {"role": "decode", "decision": "local"}),
        "remote": ("pdserve_disagg_decisions_total", {"role": "decode", "decision": "remote"}),
        "none": ("pdserve_handoff_kv_pages_total", {"role": "decode"})})
    assert got == {"local": 3.0, "remote": 5.0, "none": 0.0}
