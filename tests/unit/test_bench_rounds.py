"""pdserve bench rounds: per-round results of the side-by-side scripts, summarised by medians."""

import json

from pdserve.bench.rounds import load, main, read_metrics, summarise


def _vllm(out_tps, ttft):
    return {"output_throughput": out_tps, "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "mean_tpot_ms": 10.0}


def _ours(out_tps, ttft):
    return {"summary": {"output_throughput": out_tps,
                        "latency_ms": {"ttft": {"mean": ttft, "median": ttft}, "tpot": {"mean": None}}}}


def _write(folder, name, doc):
    (folder / name).write_text(json.dumps(doc))


def test_both_formats_are_read():
    assert read_metrics(_vllm(50.0, 100.0))["output tok/s"] == 50.0
    ours = read_metrics(_ours(60.0, 80.0))
    assert ours == {"output tok/s": 60.0, "mean TTFT ms": 80.0, "median TTFT ms": 80.0}  # null TPOT left out


def test_medians_and_per_round_ratios(tmp_path):
    # round 2 is a slow round for both: the per-round ratio stays 1.5, the medians move less
    for r, (v, p) in enumerate([(40.0, 60.0), (20.0, 30.0), (50.0, 75.0)], start=1):
        _write(tmp_path, f"vllm-single-r{r}.json", _vllm(v, 100.0))
        _write(tmp_path, f"pdserve-single-r{r}.json", _vllm(p, 50.0 * r))
    _write(tmp_path, "vllm-warmup.json", _vllm(1.0, 1.0))  # not a round: ignored
    _write(tmp_path, "server-info-123.json", {"workers": []})
    rows = summarise(load(tmp_path))
    out = {(r["system"], r["metric"]): r for r in rows}
    assert out[("vllm", "output tok/s")]["median"] == 40.0
    assert out[("vllm", "output tok/s")]["ratio"] is None
    assert out[("pdserve", "output tok/s")]["median"] == 60.0
    assert out[("pdserve", "output tok/s")]["ratio"] == 1.5
    assert out[("pdserve", "mean TTFT ms")]["ratios"] == [0.5, 1.0, 1.5]
    assert {r["case"] for r in rows} == {"single"}


def test_cache_mode_is_part_of_the_system_and_rounds_missing_a_baseline_are_skipped(tmp_path):
    _write(tmp_path, "vllm-shared-prefix-r1.json", _vllm(80.0, 400.0))
    _write(tmp_path, "pdserve-on-shared-prefix-r1.json", _ours(120.0, 200.0))
    _write(tmp_path, "pdserve-on-shared-prefix-r2.json", _ours(100.0, 300.0))  # no vLLM round 2
    _write(tmp_path, "pdserve-off-online-r1.json", _ours(30.0, 900.0))
    rows = summarise(load(tmp_path))
    on = {r["metric"]: r for r in rows if r["system"] == "pdserve-on"}
    assert on["output tok/s"]["ratios"] == [1.5] and on["output tok/s"]["median"] == 110.0
    assert on["mean TTFT ms"]["ratio"] == 0.5
    assert {(r["system"], r["case"]) for r in rows} >= {("pdserve-off", "online"), ("vllm", "shared-prefix")}


def test_main_fails_on_an_empty_folder(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    _write(tmp_path, "vllm-32-r1.json", _vllm(500.0, 700.0))
    _write(tmp_path, "pdserve-32-r1.json", _vllm(650.0, 400.0))
    assert main([str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    assert "1.30x" in capsys.readouterr().out
    assert json.loads((tmp_path / "rows.json").read_text())
