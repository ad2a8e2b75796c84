"""Per-request timelines: the stage vocabulary and builder, the worker's queue clock, and a real
PD pair (prefill dp 2, decode dp 2) answering `"return_timeline": true` with every stage in
order, non-negative gaps, the room and both ranks, and logging the same timeline at debug."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import pytest

from pdserve.core.messages import TokenOutput  # noqa: E402
from pdserve.core.timeline import ORDER, Stage, build_timeline  # noqa: E402
from pdserve.worker.queue_clock import QueueClock  # noqa: E402
from tests.harness.cluster import Server, pd_body, post_both, run, stop_all  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

DECODE_STAGES = [Stage.ARRIVAL, Stage.DISPATCH, Stage.TOPOLOGY_LOOKUP, Stage.RANK_RESOLUTION,
                 Stage.PREALLOCATION, Stage.METADATA_SENT, Stage.FIRST_KV_BYTE, Stage.LAST_KV_BYTE,
                 Stage.FIRST_TOKEN, Stage.FINISH]
PREFILL_STAGES = [Stage.ARRIVAL, Stage.DISPATCH, Stage.METADATA_RECEIVED, Stage.FIRST_KV_BYTE,
                  Stage.LAST_KV_BYTE, Stage.FIRST_TOKEN, Stage.FINISH]


# ---------------------------------------------------------------------------------------------- unit

def test_build_timeline_sorts_by_time_and_names_the_ranks():
    stages = {"finish": 10.5, "arrival": 10.0, "dispatch": 10.1, "first_token": 10.4, "unknown": 10.2,
              "last_kv_byte": 10.3, "first_kv_byte": 10.3}
    facts = {"bootstrap_room": 7, "prefill_dp_rank": 1, "decode_dp_rank": 0, "dp_rank": 0,
             "dispatch_reason": "round_robin", "dp_rank_path": "fast", "kv_bytes": 4096, "other": "x"}
    tl = build_timeline(stages, facts)
    assert [e["stage"] for e in tl["stages"]] == ["arrival", "dispatch", "first_kv_byte", "last_kv_byte",
                                                  "first_token", "finish"]  # ties keep the canonical order
    assert tl["stages"][1] == {"stage": "dispatch", "time": 10.1, "offset_s": pytest.approx(0.1),
                               "dp_rank": 0, "reason": "round_robin"}
    assert tl["stages"][3]["bytes"] == 4096 and tl["stages"][0]["offset_s"] == 0
    assert (tl["bootstrap_room"], tl["prefill_dp_rank"], tl["decode_dp_rank"]) == (7, 1, 0)
    assert "other" not in tl and "kv_bytes" not in tl


@dataclass
class Seq:
    num_computed: int = 0


def test_queue_clock_stamps_queued_and_scheduled_once():
    clock, seqs = QueueClock(), {}
    clock.watch("a")
    clock.watch("b")
    clock.before_step(seqs, 1.0)  # neither is in the engine yet (b: a decode waiting for its KV)
    seqs["a"] = Seq(0)
    clock.before_step(seqs, 2.0)
    clock.after_step(seqs, 2.0)  # a was not in the batch (no pages yet)
    seqs["b"] = Seq(9)
    clock.before_step(seqs, 3.0)
    seqs["a"].num_computed, seqs["b"].num_computed = 4, 10
    clock.after_step(seqs, 3.0)
    outs = [TokenOutput("a", [1]), TokenOutput("b", [2])]
    clock.stamp(outs)
    assert outs[0].timeline == {"queued": 2.0, "scheduled": 3.0}
    assert outs[1].timeline == {"queued": 3.0, "scheduled": 3.0}
    later = [TokenOutput("a", [3], finished=True)]
    clock.stamp(later)
    assert later[0].timeline == {} and clock.pending() == 0


# ---------------------------------------------------------------------------------------------- e2e

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("timeline"))
    model = make_tiny_model(os.path.join(work, "tiny"))
    flags = ["--log-level", "debug", "--log-format", "json"]
    p = Server("prefill", model, dp=2, log_dir=work, extra=flags)
    d = Server("decode", model, dp=2, log_dir=work, extra=flags)
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d
    finally:
        stop_all([p, d])


def room_for_rank(rank: int, dp: int = 2) -> int:
    r = random.getrandbits(62)
    return r - r % dp + rank


def assert_in_order(tl: dict, required: list[Stage]) -> dict[str, dict]:
    entries = tl["stages"]
    names = [e["stage"] for e in entries]
    assert set(s.value for s in required) <= set(names), names
    times = [e["time"] for e in entries]
    assert all(b - a >= 0 for a, b in zip(times, times[1:])), entries  # non-negative gaps
    req = [n for n in names if n in {s.value for s in required}]
    assert req == [s.value for s in required], req  # the required stages in canonical order
    assert [ORDER[n] for n in req] == sorted(ORDER[n] for n in req)
    return {e["stage"]: e for e in entries}


def logged_timelines(path: str) -> dict[str, dict]:
    out = {}
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("msg") == "timeline":
                    out[rec["rid"]] = rec
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["fast", "hint"])
def test_pd_timeline_has_every_stage_in_order_with_both_ranks(pair, path):
    P, D = pair
    decode_rank = 1 if path == "fast" else 0
    room = room_for_rank(1)
    extra = {} if path == "fast" else {"disagg_prefill_dp_rank": 0}  # the hint beats room % dp
    prefill_rank = 1 if path == "fast" else 0
    body = pd_body({"text": "The capital of France is", "return_timeline": True,
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, P, room, **extra)
    rp, rd = run(post_both(P, D, body, decode_extra={"routed_dp_rank": decode_rank}))
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    dtl, ptl = rd.json()["meta_info"]["timeline"], rp.json()["meta_info"]["timeline"]

    for tl in (dtl, ptl):
        assert (tl["bootstrap_room"], tl["prefill_dp_rank"], tl["decode_dp_rank"]) == (room, prefill_rank, decode_rank)
    d = assert_in_order(dtl, DECODE_STAGES)
    assert (d["dispatch"]["dp_rank"], d["dispatch"]["reason"]) == (decode_rank, "routed_dp_rank")
    assert (d["rank_resolution"]["prefill_dp_rank"], d["rank_resolution"]["path"]) == (prefill_rank, path)
    assert d["last_kv_byte"]["bytes"] > 0
    p = assert_in_order(ptl, PREFILL_STAGES)
    assert (p["dispatch"]["dp_rank"], p["dispatch"]["reason"]) == (prefill_rank, path)
    assert p["prefill_done"]["time"] <= p["first_kv_byte"]["time"]
    assert p["scheduled"]["time"] <= p["prefill_done"]["time"]
    # one transfer, seen from both sides; the decode asked before the prefill got the ask
    for stage in ("first_kv_byte", "last_kv_byte"):
        assert d[stage]["time"] == p[stage]["time"]
    assert d["metadata_sent"]["time"] <= p["metadata_received"]["time"]

    # the same timelines are written to the log at debug level, with the room
    for srv, resp, tl in ((D, rd, dtl), (P, rp, ptl)):
        rec = logged_timelines(srv.log_path)[resp.json()["meta_info"]["id"]]
        assert (rec["room"], rec["level"], rec["timeline"]) == (room, "debug", tl)
    P.wait_idle()
    D.wait_idle()


@pytest.mark.e2e
def test_timeline_is_only_returned_when_asked(pair):
    P, D = pair
    body = pd_body({"text": "hi", "sampling_params": {"max_new_tokens": 2}}, P, room_for_rank(0))
    rp, rd = run(post_both(P, D, body))
    assert rd.status_code == 200 and "timeline" not in rd.json()["meta_info"]
    rp, rd = run(post_both(P, D, {**body, "bootstrap_room": room_for_rank(0), "return_timeline": "yes"}))
    assert rd.status_code == 400 and "return_timeline" in rd.json()["error"]["message"]
