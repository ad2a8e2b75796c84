"""`pdserve bench rounds DIR`: side-by-side results taken in rounds, summarised by medians.

The scripts/bench_*_vs_vllm.sh scripts run each server once per round (the order alternating
between rounds) and save one result per (system, case, round) as `SYSTEM-CASE-rN.json`, in
vLLM's `bench serve --save-result` format or ours (`pdserve bench serve --output`). On a shared
VM one server's figures move 20-30% between runs minutes apart, so a single pair of runs can
land a ratio anywhere in that band; this prints, per case and metric, each system's median over
the rounds and the median of the per-round ratios against the baseline system (vllm).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"^(?P<system>[A-Za-z0-9_]+(?:-(?:on|off))?)-(?P<case>.+)-r(?P<round>\d+)\.json$")
# metric -> (vLLM result key, our summary path); lower is better for latencies
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "output tok/s": ("output_throughput", ("output_throughput",)),
    "mean TTFT ms": ("mean_ttft_ms", ("latency_ms", "ttft", "mean")),
    "median TTFT ms": ("median_ttft_ms", ("latency_ms", "ttft", "median")),
    "mean TPOT ms": ("mean_tpot_ms", ("latency_ms", "tpot", "mean")),
}


@dataclass(frozen=True)
class Result:
    system: str
    case: str
    round: int
    metrics: dict[str, float]


def read_metrics(doc: dict) -> dict[str, float]:
    """The METRICS found in one result file, either format; absent or null ones left out."""
    out: dict[str, float] = {}
    summary = doc.get("summary")
    for name, (vllm_key, ours) in METRICS.items():
        if isinstance(summary, dict):
            v = summary
            for part in ours:
                v = v.get(part) if isinstance(v, dict) else None
        else:
            v = doc.get(vllm_key)
        if isinstance(v, (int, float)):
            out[name] = float(v)
    return out


def load(folder: Path) -> list[Result]:
    results = []
    for path in sorted(folder.glob("*-r*.json")):
        m = NAME.match(path.name)
        if m is None:
            continue
        results.append(Result(m["system"], m["case"], int(m["round"]),
                              read_metrics(json.loads(path.read_text()))))
    return results


def summarise(results: list[Result], baseline: str = "vllm") -> list[dict]:
    """One row per (case, metric, system): median over rounds, the rounds' values, and the
    median of per-round ratios to `baseline` (rounds where both ran)."""
    rows = []
    cases = sorted({r.case for r in results})
    for case in cases:
        of_case = [r for r in results if r.case == case]
        systems = sorted({r.system for r in of_case}, key=lambda s: (s != baseline, s))
        for metric in METRICS:
            base = {r.round: r.metrics[metric] for r in of_case if r.system == baseline and metric in r.metrics}
            for system in systems:
                vals = {r.round: r.metrics[metric] for r in of_case if r.system == system and metric in r.metrics}
                if not vals:
                    continue
                ratios = [vals[k] / base[k] for k in sorted(vals) if k in base and base[k] > 0]
                rows.append({"case": case, "metric": metric, "system": system,
                             "median": statistics.median(vals.values()),
                             "rounds": [vals[k] for k in sorted(vals)],
                             "ratio": statistics.median(ratios) if ratios and system != baseline else None,
                             "ratios": ratios if system != baseline else []})
    return rows


def render(rows: list[dict]) -> str:
    lines = [f"{'case':<28} {'metric':<15} {'system':<12} {'median':>9}  {'ratio':>6}  rounds (ratios)"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ""
        per = " ".join(f"{v:.1f}" for v in r["rounds"])
        if r["ratios"]:
            per += "  (" + " ".join(f"{x:.2f}" for x in r["ratios"]) + ")"
        lines.append(f"{r['case']:<28} {r['metric']:<15} {r['system']:<12} {r['median']:>9.1f}  {ratio:>6}  {per}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench rounds", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a bench script's output folder (SYSTEM-CASE-rN.json files)")
    p.add_argument("--baseline", default="vllm", help="the system ratios are taken against")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    rows = summarise(load(Path(args.folder)), args.baseline)
    if not rows:
        print(f"no SYSTEM-CASE-rN.json results in {args.folder}")
        return 1
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
