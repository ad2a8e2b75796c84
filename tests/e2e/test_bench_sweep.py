"""`pdserve bench sweep`: load points, aggregation, plots from a canned result, and a short run
against the tiny model (colocated + PD) that must stop every server it started, also on SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.bench import sweep as sw  # noqa: E402
from pdserve.bench.metrics import RequestRecord, summarize  # noqa: E402
from pdserve.bench.plots import PLOT_FILES, write_plots  # noqa: E402
from pdserve.core.launcher import ProcessGroup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- pure parts ---------------------------------------------------------------------------------

def test_parse_rates_and_ints():
    assert sw.parse_rates("0.5, 1,inf") == [0.5, 1.0, math.inf]
    assert sw.parse_ints("1,2,8") == [1, 2, 8]
    assert sw.parse_ints("") == []
    for bad in ("", "0", "-1,2", "x"):
        with pytest.raises(ValueError):
            sw.parse_rates(bad)
    with pytest.raises(ValueError):
        sw.parse_ints("1,0")


def test_load_points_rates_then_concurrencies_with_distinct_seeds():
    points = sw.load_points([0.5, math.inf], [1, 4], num_prompts=6, seed=7)
    assert [(p.rate, p.max_concurrency) for p in points] == [(0.5, 0), (math.inf, 0), (math.inf, 1), (math.inf, 4)]
    assert [p.num_prompts for p in points] == [6, 6, 6, 8]  # a cap of 4 gets 2 requests per slot
    assert [p.seed for p in points] == [7, 8, 9, 10]
    assert [p.label for p in points] == ["rate=0.5", "rate=inf", "rate=inf,conc=1", "rate=inf,conc=4"]
    assert sw.load_points([1.0], [], 3, seed=1) == sw.load_points([1.0], [], 3, seed=1)  # same prompts each run


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="deployments"):
        sw.SweepConfig(deployments="colocated,bogus")
    with pytest.raises(ValueError):
        sw.SweepConfig(rates="1,0")
    with pytest.raises(ValueError):
        sw.SweepConfig(num_prompts=0)
    assert sw.main(["--deployments", "nope"]) == 2


def _record(i: int, ttft: float, itl: list[float], ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, prompt_len=10, output_len_requested=len(itl) + 1, success=ok,
                         error="" if ok else "boom", output_len=len(itl) + 1 if ok else 0,
                         ttft=ttft, e2e=ttft + sum(itl), itl=itl)


def test_point_row_takes_percentiles_and_counts_from_the_summary():
    recs = [_record(i, ttft=(i + 1) / 10, itl=[0.01 * (i + 1)] * 3) for i in range(5)] + [_record(9, 0, [], ok=False)]
    summary = dataclasses.asdict(summarize(recs, 2.0, {}))
    row = sw.point_row("pd", sw.LoadPoint(math.inf, 4, 6, 3), summary)
    assert row["deployment"] == "pd" and row["rate"] == "inf" and row["max_concurrency"] == 4
    assert (row["completed"], row["failed"]) == (5, 1)
    assert row["ttft_median_ms"] == pytest.approx(300.0)
    assert row["ttft_p90_ms"] == pytest.approx(460.0)  # linear interpolation between 400 and 500
    assert row["itl_median_ms"] == pytest.approx(30.0)
    assert row["output_throughput"] == pytest.approx(20 / 2.0)
    assert sw.point_row("c", sw.LoadPoint(0.5, 0, 6, 1), summary)["rate"] == 0.5


def test_handoff_row_splits_the_decode_side_into_parts_that_do_not_overlap():
    meta = {"prompt_tokens": 130, "bootstrap_s": 0.010, "prealloc_wait_s": 0.004, "waiting_s": 0.500,
            "kv_transfer_s": 0.020, "kv_bytes": 1 << 20, "bootstrap_room": 5, "unrelated": 1}
    row = sw.handoff_row("pd", 128, 0.75, meta)
    assert row["ttft_ms"] == pytest.approx(750.0)
    assert row["bootstrap_ms"] == pytest.approx(6.0)
    assert row["prealloc_wait_ms"] == pytest.approx(4.0)
    assert row["prefill_wait_ms"] == pytest.approx(480.0)
    assert row["transfer_ms"] == pytest.approx(20.0)
    assert row["server_prompt_tokens"] == 130 and row["kv_bytes"] == 1 << 20
    assert "unrelated" not in row["handoff"] and row["handoff"]["bootstrap_room"] == 5
    colocated = sw.handoff_row("colocated", 128, 0.5, {"prompt_tokens": 128})
    assert all(colocated[k] is None for k in ("bootstrap_ms", "prealloc_wait_ms", "prefill_wait_ms", "transfer_ms"))


def _canned_result() -> dict:
    table, lengths = [], []
    for dep, slow in (("colocated", 1.0), ("pd", 1.3)):
        for i, rate in enumerate([0.5, 1.0, "inf"]):
            table.append(_row(dep, rate, 0, slow * (i + 1)))
        for c in (1, 2, 4):
            table.append(_row(dep, "inf", c, slow * c))
        for n in (128, 512, 2048):
            meta = {"bootstrap_s": 0.002, "prealloc_wait_s": 0.0001, "waiting_s": n / 1e4,
                    "kv_transfer_s": n / 1e6, "kv_bytes": n * 1000} if dep == "pd" else {}
            lengths.append(sw.handoff_row(dep, n, slow * n / 1e4, meta))
    table[2]["itl_p99_ms"] = None  # a point with no data must not break the plot
    return {"machine": {"cores": 2}, "model_dir": "/x/tiny", "table": table, "lengths": lengths}


def _row(dep: str, rate, conc: int, scale: float) -> dict:
    row = {"deployment": dep, "rate": rate, "max_concurrency": conc, "completed": 4, "failed": 0,
           "request_throughput": 1.0 / scale, "output_throughput": 30.0 * conc / scale,
           "total_token_throughput": 90.0 / scale}
    for metric in ("ttft", "itl", "tpot", "e2e"):
        for i, p in enumerate(sw.PERCENTILES):
            row[f"{metric}_{p}_ms"] = 10.0 * scale * (i + 1)
    return row


def test_write_plots_from_a_canned_result(tmp_path):
    paths = write_plots(_canned_result(), str(tmp_path / "plots"))
    assert sorted(os.path.basename(p) for p in paths) == sorted(PLOT_FILES)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(p) > 5000


def test_write_plots_only_for_the_data_present(tmp_path):
    result = _canned_result()
    result["table"] = [r for r in result["table"] if r["max_concurrency"]]
    paths = write_plots(result, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["handoff_vs_prompt_len.png", "throughput_vs_concurrency.png"]


def test_replot_redraws_a_saved_result_without_running_anything(tmp_path):
    saved = tmp_path / "sweep.json"
    saved.write_text(json.dumps(_canned_result()))
    assert sw.main(["--replot", str(saved), "--out-dir", str(tmp_path / "again"), "--model", "/no/such/model"]) == 0
    assert sorted(os.listdir(tmp_path / "again")) == sorted(PLOT_FILES)
    assert sw.main(["--replot", str(tmp_path / "missing.json")]) == 2


def test_write_outputs_writes_strict_json(tmp_path):
    paths = sw.write_outputs({"table": [], "lengths": [], "x": 1.5}, str(tmp_path), plots=False)
    assert paths == [str(tmp_path / "sweep.json")]
    assert json.load(open(paths[0])) == {"table": [], "lengths": [], "x": 1.5}


# ---- a short real run against the tiny model ----------------------------------------------------

TINY_ARGS = ["--rates", "8,inf", "--concurrencies", "2", "--num-prompts", "3", "--input-len", "24",
             "--output-len", "6", "--probe-lens", "16,64", "--colocated-dp", "1", "--start-timeout", "120",
             "--request-timeout", "60", "--server-args", "--dtype float32 --page-size 4 --max-total-tokens 2048"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.harness.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def _alive(pid: int) -> bool:
    """The process or any member of its process group (its DP workers) still runs."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and (int(entry) == pid or int(fields[2]) == pid):  # state, ppid, pgrp
            return True
    return False


@pytest.fixture
def sweep_proc(tmp_path):
    groups: list[ProcessGroup] = []

    def start(args: list[str]) -> subprocess.Popen:
        groups.append(ProcessGroup([sys.executable, "-m", "pdserve", "bench", "sweep", *args], name="bench sweep",
                                   cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True))
        return groups[-1].proc

    yield start
    for g in groups:
        g.stop(grace_s=30.0)  # the sweep stops its servers on SIGTERM
        g.proc.stdout.close()


def _server_pids(output: str) -> list[int]:
    pids = []
    for line in output.splitlines():
        if " ready at " in line:
            pids += [int(x) for x in line.split("(pids ", 1)[1].split(")", 1)[0].split(",")]
    return pids


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_sweep_runs_both_deployments_and_stops_every_server(tiny_model, tmp_path, sweep_proc):
    out_dir = tmp_path / "out"
    p = sweep_proc(["--model", tiny_model, "--out-dir", str(out_dir), "--log-dir", str(tmp_path / "logs"), *TINY_ARGS])
    output, _ = p.communicate(timeout=170)
    assert p.returncode == 0, output
    pids = _server_pids(output)
    assert len(pids) == 4, output  # colocated; prefill, decode, router
    assert not any(_alive(pid) for pid in pids)
    result = json.load(open(out_dir / "sweep.json"))
    assert [(r["deployment"], r["rate"], r["max_concurrency"]) for r in result["table"]] == [
        (d, rate, c) for d in ("colocated", "pd") for rate, c in ((8.0, 0), ("inf", 0), ("inf", 2))]
    assert [r["completed"] for r in result["table"]] == [3, 3, 4] * 2  # a cap of 2 gets 2 requests per slot
    assert all(r["failed"] == 0 for r in result["table"])
    assert [len(run["requests"]) for run in result["runs"]] == [3, 3, 4] * 2
    pd_lengths = [r for r in result["lengths"] if r["deployment"] == "pd"]
    assert [r["server_prompt_tokens"] for r in pd_lengths] == [16, 64]
    assert all(len(r["ttft_samples_ms"]) == 2 and r["ttft_ms"] == min(r["ttft_samples_ms"]) for r in pd_lengths)
    assert all(r["transfer_ms"] is not None and r["kv_bytes"] > 0 for r in pd_lengths)
    assert pd_lengths[1]["kv_bytes"] == 4 * pd_lengths[0]["kv_bytes"]  # KV bytes grow with the prompt
    assert sorted(os.listdir(out_dir)) == sorted(["sweep.json", *PLOT_FILES])


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_sigterm_mid_sweep_stops_every_server(tiny_model, tmp_path, sweep_proc):
    p = sweep_proc(["--model", tiny_model, "--out-dir", str(tmp_path / "out"), *TINY_ARGS, "--deployments", "pd",
                    "--rates", "0.2", "--num-prompts", "50", "--concurrencies", ""])
    lines = []
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        assert line, "sweep ended before its servers were ready:\n" + "".join(lines)
        lines.append(line)
        if " ready at " in line:
            break
    pids = _server_pids("".join(lines))
    assert len(pids) == 3 and all(_alive(pid) for pid in pids)
    os.kill(p.pid, signal.SIGTERM)
    output, _ = p.communicate(timeout=60)
    assert p.returncode == 130, output
    assert "interrupted" in output
    assert not any(_alive(pid) for pid in pids)
    assert not (tmp_path / "out").exists()
