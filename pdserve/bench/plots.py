"""PNG plots of a `pdserve bench sweep` result: latency and throughput against load, and the PD
handoff cost against prompt length.

Reads only the result's `table` and `lengths` rows (see sweep.point_row / sweep.handoff_row),
so a saved sweep.json can be re-plotted. Uses matplotlib's Figure API (no pyplot global state).
"""

from __future__ import annotations

import os

from matplotlib.figure import Figure

PLOT_FILES = ("latency_vs_rate.png", "throughput_vs_rate.png", "throughput_vs_concurrency.png",
              "handoff_vs_prompt_len.png")
PERCENTILE_STYLES = (("median", "-", "p50"), ("p90", "--", "p90"), ("p99", ":", "p99"))
COLORS = {"colocated": "tab:blue", "pd": "tab:orange"}
HANDOFF_PARTS = (("bootstrap_ms", "bootstrap (resolve rank, send kv_req)"),
                 ("prealloc_wait_ms", "prealloc wait (decode KV pages)"),
                 ("prefill_wait_ms", "waiting for the prefill (queue + compute)"),
                 ("transfer_ms", "KV transfer"))


def _deployments(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["deployment"] for r in rows))


def _num(v) -> float:
    return float("nan") if v is None else float(v)


def _rate_rows(table: list[dict]) -> list[dict]:
    return [r for r in table if not r["max_concurrency"]]


def _conc_rows(table: list[dict]) -> list[dict]:
    return [r for r in table if r["max_concurrency"]]


def _rate_axis(ax, rows: list[dict]) -> dict:
    """Rates on an evenly spaced categorical axis (so 'inf' has a place); label -> x."""
    labels = list(dict.fromkeys(str(r["rate"]) for r in rows))
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("request rate (req/s; inf = all at once)")
    return {lab: i for i, lab in enumerate(labels)}


def _log2_axis(ax, ticks: list[int]) -> None:
    """A log2 x axis labelled with the measured values themselves (128, 256, ... not 2^7)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def _save(fig: Figure, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_latency_vs_rate(table: list[dict], out_dir: str, title: str) -> str:
    rows = _rate_rows(table)
    fig = Figure(figsize=(11, 4.2))
    for col, (metric, name) in enumerate((("ttft", "TTFT"), ("itl", "inter-token latency"))):
        ax = fig.add_subplot(1, 2, col + 1)
        xs = _rate_axis(ax, rows)
        for dep in _deployments(rows):
            mine = [r for r in rows if r["deployment"] == dep]
            for key, style, label in PERCENTILE_STYLES:
                ax.plot([xs[str(r["rate"])] for r in mine], [_num(r[f"{metric}_{key}_ms"]) for r in mine],
                        style, marker="o", color=COLORS.get(dep), label=f"{dep} {label}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: latency percentiles against request rate")
    return _save(fig, out_dir, PLOT_FILES[0])


def plot_throughput_vs_rate(table: list[dict], out_dir: str, title: str, output_len: int | None) -> str:
    rows = _rate_rows(table)
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    xs = _rate_axis(ax, rows)
    for dep in _deployments(rows):
        mine = [r for r in rows if r["deployment"] == dep]
        ax.plot([xs[str(r["rate"])] for r in mine], [_num(r["output_throughput"]) for r in mine],
                marker="o", color=COLORS.get(dep), label=f"{dep} output tok/s")
    finite = sorted({r["rate"] for r in rows if r["rate"] != "inf"})
    if output_len and finite:  # served below offered = saturated
        ax.plot([xs[str(r)] for r in finite], [r * output_len for r in finite], ":", color="gray",
                label=f"offered (rate x {output_len} tokens)")
    ax.set_ylabel("output tokens / s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{title}: throughput against request rate", fontsize=10)
    return _save(fig, out_dir, PLOT_FILES[1])


def plot_throughput_vs_concurrency(table: list[dict], out_dir: str, title: str) -> str:
    rows = _conc_rows(table)
    fig = Figure(figsize=(11, 4.2))
    ax, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for dep in _deployments(rows):
        mine = sorted((r for r in rows if r["deployment"] == dep), key=lambda r: r["max_concurrency"])
        conc = [r["max_concurrency"] for r in mine]
        ax.plot(conc, [_num(r["output_throughput"]) for r in mine], marker="o", color=COLORS.get(dep),
                label=f"{dep}")
        ax2.plot(conc, [_num(r["ttft_median_ms"]) for r in mine], marker="o", color=COLORS.get(dep),
                 label=f"{dep} TTFT p50")
        ax2.plot(conc, [_num(r["itl_median_ms"]) for r in mine], "--", marker="s", color=COLORS.get(dep),
                 label=f"{dep} ITL p50")
    for a in (ax, ax2):
        _log2_axis(a, sorted({r["max_concurrency"] for r in rows}))
        a.set_xlabel("max concurrency (requests in flight)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax2.set_ylabel("latency (ms)")
    ax2.set_yscale("log")
    fig.suptitle(f"{title}: throughput and latency against concurrency")
    return _save(fig, out_dir, PLOT_FILES[2])


def plot_handoff_vs_prompt_len(lengths: list[dict], out_dir: str, title: str) -> str:
    fig = Figure(figsize=(11, 4.2))
    ax, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    pd_rows = sorted((r for r in lengths if r.get("transfer_ms") is not None), key=lambda r: r["prompt_len"])
    for key, label in HANDOFF_PARTS:
        ax.plot([r["prompt_len"] for r in pd_rows], [_num(r[key]) for r in pd_rows], marker="o", label=label)
    ax.set_ylabel("time on the decode side (ms)")
    ax.set_title("PD handoff breakdown (one request per length)", fontsize=10)
    for dep in _deployments(lengths):
        mine = sorted((r for r in lengths if r["deployment"] == dep), key=lambda r: r["prompt_len"])
        ax2.plot([r["prompt_len"] for r in mine], [_num(r["ttft_ms"]) for r in mine], marker="o",
                 color=COLORS.get(dep), label=f"{dep} TTFT")
    ax2.plot([r["prompt_len"] for r in pd_rows], [_num(r["transfer_ms"]) for r in pd_rows], "--", marker="s",
             color=COLORS.get("pd"), label="pd KV transfer")
    ax2.set_ylabel("ms")
    ax2.set_title("TTFT and KV transfer time against prompt length", fontsize=10)
    for a in (ax, ax2):
        _log2_axis(a, sorted({r["prompt_len"] for r in lengths}))
        a.set_yscale("log")
        a.set_xlabel("prompt tokens")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, out_dir, PLOT_FILES[3])


def write_plots(result: dict, out_dir: str) -> list[str]:
    """Write every plot the result has data for into `out_dir`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    machine = result.get("machine") or {}
    title = f"{os.path.basename(result.get('model_dir') or 'model')}, {machine.get('cores', '?')} CPU cores"
    table, lengths = result.get("table") or [], result.get("lengths") or []
    paths = []
    if _rate_rows(table):
        output_len = (result.get("config") or {}).get("output_len")
        paths += [plot_latency_vs_rate(table, out_dir, title),
                  plot_throughput_vs_rate(table, out_dir, title, output_len)]
    if _conc_rows(table):
        paths.append(plot_throughput_vs_concurrency(table, out_dir, title))
    if lengths:
        paths.append(plot_handoff_vs_prompt_len(lengths, out_dir, title))
    return paths
