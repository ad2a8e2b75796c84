"""Prometheus metrics: counters move by exactly the traffic sent, histogram counts match, and the
KV transfer speed is bytes over the backend's own write calls.

Unit tests drive FrontMetrics and a real tcp transfer in-process; the end-to-end test scrapes
/metrics of a real prefill (dp 2), decode (dp 2, always querying the prefill DP rank) and router
before and after known traffic.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.core.errors import BadRequest  # noqa: E402
from pdserve.core.kv_layout import KVLayout  # noqa: E402
from pdserve.core.launcher import ProcessGroup, http_ok  # noqa: E402
from pdserve.core.messages import ErrorInfo, TokenOutput, WorkerStats  # noqa: E402
from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.disagg.bootstrap_table import RankInfo  # noqa: E402
from pdserve.disagg.decode_events import RankResolved, Resolved  # noqa: E402
from pdserve.disagg.kv_receiver import DecodeReceiver, ReceiverLimits  # noqa: E402
from pdserve.disagg.kv_sender import PrefillSender  # noqa: E402
from pdserve.disagg.local_facts import LocalFacts  # noqa: E402
from pdserve.disagg.prefill_events import PrefillFacts  # noqa: E402
from pdserve.router.metrics import RouterMetrics  # noqa: E402
from pdserve.server.metrics import FrontMetrics  # noqa: E402
from pdserve.server.protocol import RequestItem  # noqa: E402
from pdserve.server.request_state import ItemProgress  # noqa: E402
from pdserve.server.tokenizer import ServerTokenizer  # noqa: E402
from pdserve.transfer import tcp_wire  # noqa: E402
from pdserve.transfer.tcp import TcpBackend  # noqa: E402
from tests.harness.cluster import ROOT, Server, free_port, pd_body, post_both, run, stop_all  # noqa: E402
from tests.harness.fake_worker import write_fake_model  # noqa: E402
from tests.harness.handoff_harness import FakePrefillLink  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

PAGE_SIZE = 4  # tests/harness/cluster.py starts servers with --page-size 4
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32 (tiny model)


# ---------------------------------------------------------------------------------------------- helpers

def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return samples(r.text)


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def moved(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    write_fake_model(path)
    return ServerTokenizer.from_dir(path)


def progress(tok, rid: str = "r", prompt: int = 3, new: int = 4) -> ItemProgress:
    item = RequestItem(0, rid, list(range(5, 5 + prompt)), SamplingParams(max_new_tokens=new), True)
    return ItemProgress(item, tok)


def feed(m: FrontMetrics, prog: ItemProgress, out: TokenOutput) -> None:
    """What ActiveRequest.events does with one worker output."""
    n, prev = len(prog.output_ids), prog.last_token_at
    prog.apply(out)
    m.tokens_arrived(prog, len(prog.output_ids) - n, prev)
    if prog.finished:
        m.item_finished(prog)


# ---------------------------------------------------------------------------------------------- unit

def test_token_histograms_count_every_token_once(tok):
    m = FrontMetrics("decode", "inst", "0")
    prog = progress(tok, new=6)
    m.items_started(1)
    feed(m, prog, TokenOutput("r", [10, 11]))  # the first output carries two tokens
    feed(m, prog, TokenOutput("r", [12]))
    feed(m, prog, TokenOutput("r", [13, 14, 15], finished=True, finish_reason={"type": "length"},
                              timeline={"queued": 100.0, "scheduled": 100.25}))
    s = samples(m.render().decode())
    assert value(s, "pdserve_time_to_first_token_seconds_count", role="decode") == 1
    assert value(s, "pdserve_inter_token_latency_seconds_count", role="decode") == 6 - 1
    assert value(s, "pdserve_generation_tokens_total", role="decode") == 6
    assert value(s, "pdserve_prompt_tokens_total", role="decode") == 3
    assert value(s, "pdserve_items_finished_total", role="decode", finish_reason="length") == 1
    assert value(s, "pdserve_queue_time_seconds_sum", role="decode") == pytest.approx(0.25)
    assert value(s, "pdserve_running_items", role="decode") == 0
    assert value(s, "pdserve_server_info", role="decode", instance_id="inst", version="0") == 1


def test_failures_are_counted_by_cause(tok):
    m = FrontMetrics("prefill")
    m.rejected(BadRequest("follow_bootstrap_room conflict: dispatched to dp_rank 0 but ..."), 1)
    m.rejected(BadRequest("token id 9999 is outside the vocabulary"), 2)
    m.items_started(3)
    for rid, cause, etype in (("a", "timeout", "handoff_error"), ("b", None, "aborted"), ("c", None, "worker_error")):
        feed(m, progress(tok, rid), TokenOutput(rid, finished=True, finish_reason={"type": "abort"},
                                                error=ErrorInfo(500, "boom", etype),
                                                meta={"failure_cause": cause} if cause else {}))
    s = samples(m.render().decode())
    got = {dict(k[1])["cause"]: v for k, v in s.items() if k[0] == "pdserve_request_failures_total"}
    assert got == {"conflict": 1, "bad_request": 2, "timeout": 1, "aborted": 1, "worker_gone": 1}
    assert value(s, "pdserve_dp_rank_conflicts_total", role="prefill") == 1
    assert value(s, "pdserve_items_finished_total", role="prefill", finish_reason="abort") == 1
    assert value(s, "pdserve_items_finished_total", role="prefill", finish_reason="error") == 2


def test_worker_gauges_follow_the_latest_stats():
    m = FrontMetrics("decode")
    busy = WorkerStats(1, 0, 64, 60, 0, 2, 1, 3, {"preallocated_requests": 1,
                                                   "handoff_states": {"bootstrapping": 2, "waiting_for_input": 1}})
    m.worker_stats([busy])
    m.worker_liveness(2, {1: "exited"})
    s = samples(m.render().decode())
    assert value(s, "pdserve_kv_pages_free", role="decode", dp_rank=0) == 60
    assert value(s, "pdserve_worker_running_requests", role="decode", dp_rank=0) == 2
    assert value(s, "pdserve_worker_preallocated_requests", role="decode", dp_rank=0) == 1
    assert value(s, "pdserve_handoff_rooms", role="decode", dp_rank=0, state="bootstrapping") == 2
    assert value(s, "pdserve_worker_up", role="decode", dp_rank=1) == 0
    m.worker_stats([WorkerStats(2, 0, 64, 64, 0, 0, 0, 0, {"preallocated_requests": 0, "handoff_states": {}})])
    s = samples(m.render().decode())
    assert value(s, "pdserve_handoff_rooms", role="decode", dp_rank=0, state="bootstrapping") == 0
    assert value(s, "pdserve_kv_pages_free", role="decode", dp_rank=0) == 64


def test_docs_and_dashboard_name_every_metric_and_only_real_ones():
    """docs/observability.md lists every series; the Grafana dashboard queries only real ones."""
    names = {m.name + ("_total" if m.type == "counter" else "")
             for reg in (FrontMetrics("decode").registry, RouterMetrics().registry) for m in reg.collect()}
    docs = os.path.join(ROOT, "docs")
    with open(os.path.join(docs, "observability.md")) as f:
        text = f.read()
    assert not [n for n in names if f"`{n}`" not in text]
    with open(os.path.join(docs, "grafana-dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {w for e in exprs for w in re.findall(r"pdserve_\w+", e)}
    base = {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}
    assert base <= names, base - names
    assert len(used) > 20


def _pool(regions: int, pages: int, page_bytes: int, seed: int | None):
    n = regions * pages * page_bytes
    arr = np.zeros(n, np.uint8) if seed is None else np.random.default_rng(seed).integers(0, 256, n, np.uint8)
    return arr, KVLayout(arr.ctypes.data, regions, pages, page_bytes, pages * page_bytes, PAGE_SIZE, "float32")


def test_transfer_speed_is_bytes_over_the_backends_own_write_calls(monkeypatch):
    """A 16 MiB handoff over real tcp sockets: the speed both sides export equals the bytes over
    the span of the backend's socket write calls (timed here, around tcp_wire.send_gather)."""
    regions, pages, page_bytes, room = 4, 64, 64 << 10, 77
    p_mem, p_layout = _pool(regions, pages, page_bytes, 1)
    d_mem, d_layout = _pool(regions, pages, page_bytes, None)
    calls: list[tuple[float, float]] = []
    real = tcp_wire.send_gather

    def timed(sock, bufs):
        t0 = time.perf_counter()
        real(sock, bufs)
        calls.append((t0, time.perf_counter()))

    monkeypatch.setattr(tcp_wire, "send_gather", timed)
    pb, db = TcpBackend(), TcpBackend()
    fp = {"architecture": "x", "num_layers": 1}
    try:
        locs = [LocalFacts.of("tcp", lay, fp, be.start(lay)) for be, lay in ((pb, p_layout), (db, d_layout))]
        sender = PrefillSender(pb, 0, locs[0], bootstrap_timeout=30)
        receiver = DecodeReceiver(db, 1, locs[1], link=FakePrefillLink(), reserve=lambda rid, n: list(range(pages)),
                                  limits=ReceiverLimits(waiting_timeout=30))
        ep = locs[0].endpoint
        info = RankInfo(dp_rank=0, dp_size=1, rank_ip=ep["ip"], rank_port=ep["port"], page_size=PAGE_SIZE,
                        kv_cache_dtype="float32", load_balance_method="auto", fingerprint=fp, endpoint=ep,
                        transfer_backend="tcp")
        prompt = pages * PAGE_SIZE
        sender.accept(room, "p", prompt)
        receiver.accept(room, "d", "x:1", prompt, None)
        receiver.inbox.post(RankResolved(Resolved(room, "x:1", 0, "single", info, "i", topology_at=1.0,
                                                  resolved_at=1.0)))
        sender.prefill_done(room, list(range(pages))[::-1], PrefillFacts(first_token=5, prompt_len=prompt))
        p_done, d_done, end = [], [], time.monotonic() + 30
        while not (p_done and d_done):
            assert time.monotonic() < end, "the handoff did not finish"
            for s, msg in pb.recv(0.01):
                sender.on_message(s, msg)
            for s, msg in db.recv(0.01):
                receiver.on_message(s, msg)
            p_done += sender.poll()
            d_done += receiver.poll()
        assert p_done[0].ok and d_done[0].ok, (p_done, d_done)
    finally:
        pb.close()
        db.close()
    assert np.array_equal(d_mem.reshape(regions, pages, -1), p_mem.reshape(regions, pages, -1)[:, ::-1])
    moved_bytes = regions * pages * page_bytes
    measured = moved_bytes / (calls[-1][1] - calls[0][0])
    for role, done in (("prefill", p_done[0]), ("decode", d_done[0])):
        m = FrontMetrics(role)
        m.handoff(done.meta)
        s = samples(m.render().decode())
        assert value(s, "pdserve_kv_transfer_bytes_sum", role=role) == moved_bytes
        speed = value(s, "pdserve_kv_transfer_throughput_bytes_per_second_sum", role=role)
        assert speed == pytest.approx(measured, rel=0.2), (role, speed / 1e9, measured / 1e9)


# ---------------------------------------------------------------------------------------------- e2e

class Router:
    """`pdserve router` on a free port in its own process group; `stop()` kills the group."""

    def __init__(self, prefill: Server, decode: Server, log_dir: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve", "router", "--pd-disaggregation", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", "--prefill", prefill.url,
               str(prefill.bootstrap_port), "--decode", decode.url]
        self.group = ProcessGroup(cmd, name="router", log_path=os.path.join(log_dir, f"router-{self.port}.log"),
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 60.0) -> None:
        self.group.wait_healthy(lambda: http_ok(self.url + "/health"), timeout, what="/health")

    def stop(self) -> None:
        self.group.stop(grace_s=10.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("metrics"))
    model = make_tiny_model(os.path.join(work, "tiny"))
    p = Server("prefill", model, dp=2, log_dir=work, extra=["--log-level", "debug", "--log-format", "json"])
    d = Server("decode", model, dp=2, log_dir=work, extra=["--force-query-prefill-dp-rank"])
    router = None
    try:
        p.wait_ready()
        d.wait_ready()
        router = Router(p, d, work)
        router.wait_healthy()
        yield p, d, router
    finally:
        if router is not None:
            router.stop()
        stop_all([p, d])


def kv_writes(log_path: str) -> dict[int, dict]:
    """room -> the prefill backend's own record of its page write (debug "kv write" lines)."""
    out = {}
    with open(log_path) as f:
        for line in f:
            if line.startswith("{") and '"kv write"' in line:
                rec = json.loads(line)
                out[rec["room"]] = rec
    return out


@pytest.mark.e2e
def test_counters_move_by_exactly_the_traffic_sent(cluster):
    P, D, R = cluster
    # no prompt starts like another: a decode would reuse the shared pages and move fewer bytes
    prompts = [list(range(40 + 30 * k, 40 + 30 * k + n)) for k, n in enumerate((5, 9, 3, 14))]
    new = 6
    sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    before = {name: scrape(srv.url) for name, srv in (("p", P), ("d", D), ("r", R))}

    rooms = []
    for ids in prompts:  # through the router: the decode resolves by query (its FORCE is on)
        r = httpx.post(R.url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == new
        rooms.append(r.json()["meta_info"]["bootstrap_room"])
    hint_ids = list(range(20, 27))  # pinned by the hint: the decode asks nobody
    room = random.getrandbits(63)
    rp, rd = run(post_both(P, D, pd_body({"input_ids": hint_ids, "sampling_params": sp}, P, room,
                                         disagg_prefill_dp_rank=(room + 1) % 2)))
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    rooms.append(room)
    conflict_rooms = [random.getrandbits(63) for _ in range(2)]
    for room in conflict_rooms:  # routed elsewhere than room % dp: the prefill rejects the room
        body = pd_body({"input_ids": [7, 8, 9], "sampling_params": sp}, P, room, routed_dp_rank=(room + 1) % 2)
        rp, rd = run(post_both(P, D, body))
        assert rp.status_code == 400 and "conflict" in rp.text, rp.text
        assert rd.status_code == 500 and "conflict" in rd.text, rd.text
    P.wait_idle()
    D.wait_idle()
    after = {name: scrape(srv.url) for name, srv in (("p", P), ("d", D), ("r", R))}

    ok = len(prompts) + 1
    prompt_tokens = sum(map(len, prompts)) + len(hint_ids)
    kv_bytes = sum(-(-len(ids) // PAGE_SIZE) * PAGE_SIZE * KV_BYTES_PER_TOKEN for ids in [*prompts, hint_ids])
    p, d, r = (lambda name, **lb: moved(after["p"], before["p"], name, role="prefill", **lb),
               lambda name, **lb: moved(after["d"], before["d"], name, role="decode", **lb),
               lambda name, **lb: moved(after["r"], before["r"], name, **lb))

    assert r("pdserve_router_requests_total", route="/generate", status="200") == len(prompts)
    assert r("pdserve_router_upstream_latency_seconds_count", role="prefill", server=P.url) == len(prompts)
    assert r("pdserve_router_upstream_latency_seconds_count", role="decode", server=D.url) == len(prompts)

    assert p("pdserve_http_requests_total", route="/generate", status="200") == ok
    assert p("pdserve_http_requests_total", route="/generate", status="400") == len(conflict_rooms)
    assert p("pdserve_dp_rank_conflicts_total") == len(conflict_rooms)
    assert p("pdserve_request_failures_total", cause="conflict") == len(conflict_rooms)
    assert p("pdserve_items_total") == ok
    assert p("pdserve_dispatch_total", dp_rank=0, reason="fast") + p("pdserve_dispatch_total", dp_rank=1,
                                                                     reason="fast") == len(prompts)
    assert p("pdserve_items_finished_total", finish_reason="length") == ok
    assert (p("pdserve_prompt_tokens_total"), p("pdserve_generation_tokens_total")) == (prompt_tokens, ok)

    assert d("pdserve_http_requests_total", route="/generate", status="200") == ok
    assert d("pdserve_http_requests_total", route="/generate", status="500") == len(conflict_rooms)
    assert d("pdserve_items_total") == ok + len(conflict_rooms)
    assert d("pdserve_dp_rank_resolutions_total", path="query") == len(prompts)
    assert d("pdserve_dp_rank_resolutions_total", path="hint") == 1
    assert d("pdserve_request_failures_total", cause="conflict") == len(conflict_rooms)
    assert d("pdserve_items_finished_total", finish_reason="error") == len(conflict_rooms)
    assert (d("pdserve_prompt_tokens_total") - 3 * len(conflict_rooms), d("pdserve_generation_tokens_total")) \
        == (prompt_tokens, ok * new)

    # histogram counts: one observation per item, token or transfer
    assert d("pdserve_time_to_first_token_seconds_count") == ok
    assert d("pdserve_inter_token_latency_seconds_count") == ok * (new - 1)
    assert d("pdserve_e2e_request_latency_seconds_count") == ok + len(conflict_rooms)
    assert d("pdserve_queue_time_seconds_count") == ok
    assert d("pdserve_handoff_rank_resolution_seconds_count") == ok
    assert p("pdserve_time_to_first_token_seconds_count") == ok
    assert p("pdserve_e2e_request_latency_seconds_count") == ok
    for side in (p, d):
        assert side("pdserve_kv_transfer_seconds_count") == ok
        assert side("pdserve_kv_transfer_bytes_count") == ok
        assert side("pdserve_kv_transfer_bytes_sum") == kv_bytes
        assert side("pdserve_handoff_bootstrap_wait_seconds_count") == ok

    # the exported speed is bytes over the window of the prefill backend's own write (its log)
    writes = kv_writes(P.log_path)
    assert [writes[room]["bytes"] for room in rooms] == \
        [-(-len(ids) // PAGE_SIZE) * PAGE_SIZE * KV_BYTES_PER_TOKEN for ids in [*prompts, hint_ids]]
    want = sum(writes[room]["bytes"] / (writes[room]["finished_at"] - writes[room]["started_at"]) for room in rooms)
    for side in (p, d):
        assert side("pdserve_kv_transfer_throughput_bytes_per_second_sum") == pytest.approx(want, rel=0.2)

    # per-rank gauges are fresh at scrape time: everything is back to idle
    for srv, role in ((after["p"], "prefill"), (after["d"], "decode")):
        for rank in (0, 1):
            assert value(srv, "pdserve_worker_up", role=role, dp_rank=rank) == 1
            assert value(srv, "pdserve_kv_pages_free", role=role, dp_rank=rank) + \
                value(srv, "pdserve_kv_pages_cached", role=role, dp_rank=rank) == \
                value(srv, "pdserve_kv_pages_total", role=role, dp_rank=rank) > 0
            for g in ("running_requests", "waiting_requests", "preallocated_requests", "inflight_transfers"):
                assert value(srv, f"pdserve_worker_{g}", role=role, dp_rank=rank) == 0


@pytest.mark.e2e
def test_labels_are_bounded(cluster):
    """No label value holds a room or a rid: every value comes from a small known set."""
    P, D, R = cluster
    for srv in (P, D, R):
        for (name, labels) in scrape(srv.url):
            for key, v in labels:
                assert key not in ("room", "rid", "bootstrap_room"), (name, key)
                assert not (v.isdigit() and len(v) > 6), (name, key, v)
