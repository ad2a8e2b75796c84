"""What the prefill machine says about one room: the KvDone and KvFail its decode gets, and the
HandoffDone its caller gets when it is over, with the meta_info the front shows (each handoff
state's time, ranks, forwarding, the transfer's bytes and rate, failure cause)."""

from __future__ import annotations

from typing import Any

from ..core.failures import FailureCause
from . import wire
from .handoff import HandoffDone, HandoffState, write_meta, write_stages
from .prefill_rooms import PrefillRoom, RoomState

H, R = HandoffState, RoomState
# the engine's facts about a finished prefill that a KvDone carries
DONE_FIELDS = ("first_token", "first_logprob", "first_top_logprobs", "input_logprobs", "input_top_logprobs",
               "prompt_len", "cached_tokens")


def kv_done(r: PrefillRoom, dp_rank: int) -> wire.KvDone:
    """The KvDone that follows `r`'s pages (the write fills in its facts); TypeError when the
    engine's facts lack the first token."""
    aux = r.aux or {}
    facts = {k: aux[k] for k in DONE_FIELDS if aux.get(k) is not None}
    return wire.KvDone(room=r.room, prefill_rank=dp_rank, **facts)


def kv_fail(room: int, dp_rank: int, reason: str, cause: FailureCause) -> wire.KvFail:
    return wire.KvFail(room=room, prefill_rank=dp_rank, reason=reason, cause=cause.value)


def room_report(r: PrefillRoom, dp_rank: int) -> HandoffDone:
    """`r` as its caller hears it: ok (SUCCESS) or not, reason, aux, meta, stages, dropped."""
    return HandoffDone(r.room, r.rid, r.state is R.SUCCESS, r.reason, r.aux, room_meta(r, dp_rank),
                       {**r.stages, **write_stages(r.write)}, r.state.dropped)


def room_meta(r: PrefillRoom, dp_rank: int) -> dict[str, Any]:
    d: dict[str, Any] = {f"prefill_{k}_s": v for k, v in r.handoff.durations().items()}  # as Handoff reports them
    d.update({"bootstrap_room": r.room, "prefill_dp_rank": dp_rank})
    if r.req is not None:
        d["decode_dp_rank"] = r.req.decode_rank
        if r.req.forwarded_by is not None:
            d["kv_req_forwarded_by"] = r.req.forwarded_by
    if r.state.dropped:
        d["disaggregation"] = "dropped"  # the decode prefilled it
    elif r.state.handoff is H.FAILED:
        d["failure_cause"] = r.cause.value
    if r.write is not None:
        d.update(write_meta(r.write))
    return d
