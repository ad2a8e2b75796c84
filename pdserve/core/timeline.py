"""The per-request timeline: named stages with wall-clock times, recorded in whichever process
the stage happens (front, worker, the prefill's backend) and assembled by the front.

Times are `time.time()` because the stages of one request happen in several processes (and,
for a PD pair, on two servers); on one host they share a clock, across hosts they are as
good as the hosts' clock sync. A worker sends its stages in `TokenOutput.timeline`.
"""

from __future__ import annotations

import enum
from typing import Any


class Stage(str, enum.Enum):
    """Stages in the order a request normally passes them (the canonical order)."""

    ARRIVAL = "arrival"  # front: the request was parsed
    DISPATCH = "dispatch"  # front: sent to a DP worker (dp_rank, reason)
    TOPOLOGY_LOOKUP = "topology_lookup"  # decode worker: the prefill's topology is in hand
    RANK_RESOLUTION = "rank_resolution"  # decode worker: prefill DP rank and its endpoint known
    PREALLOCATION = "preallocation"  # decode worker: KV pages reserved for the prompt
    METADATA_SENT = "metadata_sent"  # decode worker: kv_req issued to the prefill worker
    METADATA_RECEIVED = "metadata_received"  # prefill worker: the decode's kv_req arrived
    QUEUED = "queued"  # worker: the request entered the engine (decode: after its KV arrived)
    SCHEDULED = "scheduled"  # worker: the engine's first forward step that included it
    PREFILL_DONE = "prefill_done"  # prefill worker: the prompt's KV is in its pages
    FIRST_KV_BYTE = "first_kv_byte"  # prefill backend: the page write started moving bytes
    LAST_KV_BYTE = "last_kv_byte"  # prefill backend: the last byte left (tcp) / landed
    FIRST_TOKEN = "first_token"  # front: the first output token arrived
    FINISH = "finish"  # front: the item finished (success or not)


ORDER = {s.value: i for i, s in enumerate(Stage)}
# facts shown on a stage's entry: stage -> ((entry key, fact key), ...)
STAGE_FACTS: dict[Stage, tuple[tuple[str, str], ...]] = {
    Stage.DISPATCH: (("dp_rank", "dp_rank"), ("reason", "dispatch_reason")),
    Stage.RANK_RESOLUTION: (("prefill_dp_rank", "prefill_dp_rank"), ("path", "dp_rank_path")),
    Stage.SCHEDULED: (("cached_tokens", "cached_tokens"),),  # prompt tokens the prefix cache held
    Stage.PREALLOCATION: (("reused_pages", "kv_reused_pages"), ("transferred_pages", "kv_transferred_pages")),
    Stage.LAST_KV_BYTE: (("bytes", "kv_bytes"),),
}
TOP_FACTS = ("bootstrap_room", "prefill_dp_rank", "decode_dp_rank", "dp_rank", "dispatch_reason",
             "dp_rank_path", "cached_tokens", "failure_cause", "disaggregation")


def build_timeline(stages: dict[str, float], facts: dict[str, Any]) -> dict[str, Any]:
    """The `timeline` of meta_info: top-level facts (room, both ranks) and the recorded stages
    sorted by time (canonical order breaks ties), each with its offset from arrival."""
    known = [(t, ORDER[name], name) for name, t in stages.items() if name in ORDER and t]
    known.sort()
    t0 = stages.get(Stage.ARRIVAL.value) or (known[0][0] if known else 0.0)
    entries = []
    for t, _, name in known:
        entry: dict[str, Any] = {"stage": name, "time": round(t, 6), "offset_s": round(t - t0, 6)}
        for key, fact in STAGE_FACTS.get(Stage(name), ()):
            if facts.get(fact) is not None:
                entry[key] = facts[fact]
        entries.append(entry)
    out = {k: facts[k] for k in TOP_FACTS if facts.get(k) is not None}
    out["stages"] = entries
    return out
