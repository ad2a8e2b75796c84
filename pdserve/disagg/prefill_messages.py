"""What the prefill machine says about one room: the KvDone and KvFail its decode gets, and the
HandoffDone its caller gets when it is over, with the meta_info the front shows (each handoff
state's time, ranks, forwarding, the transfer's bytes and rate, failure cause)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.failures import FailureCause
from . import wire
from .handoff import HandoffDone, HandoffState, write_meta, write_stages
from .prefill_events import PrefillFacts
from .prefill_rooms import PrefillRoom, RoomState

H, R = HandoffState, RoomState


def kv_done(r: PrefillRoom, dp_rank: int) -> wire.KvDone:
    """The KvDone that follows `r`'s pages, carrying its PrefillFacts (the write job adds its
    WriteResult); TypeError (msgspec's, naming the field) when the engine sampled no first token."""
    facts = {f.name: getattr(r.aux, f.name) for f in dataclasses.fields(PrefillFacts)} if r.aux else {}
    return wire.KvDone(room=r.room, prefill_rank=dp_rank, **{k: v for k, v in facts.items() if v is not None})


def kv_fail(room: int, dp_rank: int, reason: str, cause: FailureCause) -> wire.KvFail:
    return wire.KvFail(room=room, prefill_rank=dp_rank, reason=reason, cause=cause.value)


def room_report(r: PrefillRoom, dp_rank: int) -> HandoffDone[PrefillFacts]:
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
