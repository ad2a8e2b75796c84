"""What the decode machine says about one room: the KvReq and KvAbort its prefill gets, and the
HandoffDone its caller gets when it is over, with the meta_info the front shows (ranks, how long
each part took, pages reused and moved, the transfer's rate, admission)."""

from __future__ import annotations

from typing import Any

from . import wire
from .decode_events import SendAbort
from .decode_rooms import DecodeRoom, DecodeState
from .handoff import HandoffDone, HandoffState, write_meta
from .local_facts import LocalFacts

D, H = DecodeState, HandoffState


def kv_req(r: DecodeRoom, dp_rank: int, local: LocalFacts) -> wire.KvReq:
    """The request for `r`'s KV to its resolved prefill rank: where to write (the pages it
    reserved, less those it reuses) and what this decode is (`local`)."""
    res, got = r.resolved, r.reservation
    assert res is not None and got is not None
    return wire.KvReq(room=r.room, dst_pages=got.pages[got.reused_pages:], prompt_len=r.prompt_len,
                      layout=local.layout, endpoint=local.endpoint, page_size=local.page_size,
                      kv_dtype=local.kv_dtype, fingerprint=local.fingerprint, backend=local.backend,
                      decode_rank=dp_rank, prefill_rank=res.rank, prefill_instance=res.instance_id,
                      reused_pages=got.reused_pages, reused_key=got.reused_key)


def kv_abort(r: DecodeRoom, dp_rank: int, local: LocalFacts) -> SendAbort:
    """Tell `r`'s prefill rank the room is off, with the reason it failed."""
    assert r.resolved is not None and r.resolved.info is not None
    return SendAbort(r.room, r.resolved.info.peer(), wire.KvAbort(
        room=r.room, reason=r.reason, decode_rank=dp_rank, endpoint=local.endpoint))


def room_report(r: DecodeRoom, dp_rank: int, retry_after: int) -> HandoffDone[wire.KvDone]:
    """`r` as its caller hears it: ok (DONE) or not, reason, its KvDone, meta, stages."""
    return HandoffDone(r.room, r.rid, r.state is D.DONE, r.reason, r.aux, room_meta(r, dp_rank, retry_after),
                       dict(r.stages))


def room_meta(r: DecodeRoom, dp_rank: int, retry_after: int) -> dict[str, Any]:
    """The meta_info of `r`; `retry_after` is what a refused room tells its client."""
    h = r.handoff
    d: dict[str, Any] = {"bootstrap_room": r.room, "decode_dp_rank": dp_rank}
    if r.state in (D.FAILED, D.QUARANTINED):
        d["failure_cause"] = r.cause.value
    if r.refused:
        d.update(admission="refused", admission_refused=r.refused, retry_after_s=retry_after)
    if r.resolved is not None:
        d.update(prefill_dp_rank=r.resolved.rank, dp_rank_path=r.resolved.path, resolve_s=r.resolved.seconds)
        got = r.reservation
        if got is not None:
            d["prealloc_wait_s"] = r.entered[D.SENDING] - r.entered[D.RESERVING]
            d["kv_reused_pages"] = got.reused_pages  # already on this decode: not moved
            d["kv_transferred_pages"] = len(got.pages) - got.reused_pages
    if H.WAITING_FOR_INPUT in h.entered:
        d["bootstrap_s"] = h.entered[H.WAITING_FOR_INPUT] - h.created
        d["waiting_s"] = h.entered[h.state] - h.entered[H.WAITING_FOR_INPUT]
    if r.aux is not None and r.aux.write is not None:
        d.update(write_meta(r.aux.write))
    return d
