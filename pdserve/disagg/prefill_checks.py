"""The checks a decode's KvReq must pass on a prefill rank: that it fits this rank (transfer
backend, page size, KV dtype, model), names this server's instance and a room that can still
succeed here; then, once its room is here, that both legs got the same prompt (page counts,
the key of the prefix the decode reuses). Each says what is wrong in words, or None."""

from __future__ import annotations

from ..core.failures import FailureCause
from ..core.page_keys import prefix_key
from . import wire
from .local_facts import LocalFacts, compat_problem
from .prefill_notes import Doomed
from .prefill_rooms import PrefillRoom


def kv_req_problem(msg: wire.KvReq, local: LocalFacts, dp_rank: int, instance_id: str,
                   doomed: dict[int, Doomed]) -> tuple[str | None, FailureCause]:
    """Why this rank cannot take `msg` at all, and the failure's cause; (None, INTERNAL) if it can.
    `instance_id` "" skips the instance check."""
    room = msg.room
    problem = compat_problem(local, msg)
    if problem is not None:
        return (f"room {room}: decode dp_rank {msg.decode_rank} cannot use prefill dp_rank "
                f"{dp_rank}: {problem}"), FailureCause.INCOMPATIBLE
    if instance_id and msg.prefill_instance and msg.prefill_instance != instance_id:
        return (f"room {room}: the decode resolved prefill dp_rank {dp_rank} on bootstrap "
                f"instance {msg.prefill_instance}, but this server is instance {instance_id}: "
                "the prefill restarted and lost the room"), FailureCause.PEER_GONE
    if room in doomed:
        return doomed[room].reason, doomed[room].cause
    return None, FailureCause.INTERNAL


def prompt_problem(r: PrefillRoom, req: wire.KvReq, page: int) -> str | None:
    """Why `req` does not fit room `r`'s prompt (`page`: tokens a page); None if it does."""
    need = -(-r.prompt_len // page) - req.reused_pages
    if len(req.dst_pages) != need or req.prompt_len != r.prompt_len:
        return (f"room {r.room}: decode sent {len(req.dst_pages)} pages (reusing "
                f"{req.reused_pages}) for {req.prompt_len} tokens, prefill has {r.prompt_len} "
                f"tokens ({need + req.reused_pages} pages): the two legs got different prompts")
    if req.reused_pages and not 0 < req.reused_pages <= r.prompt_len // page:
        return (f"room {r.room}: decode claims {req.reused_pages} reused pages of a "
                f"{r.prompt_len}-token prompt ({r.prompt_len // page} full pages)")
    if req.reused_pages and (r.prompt_ids is None or
                             prefix_key(r.prompt_ids, page, req.reused_pages) != req.reused_key):
        return (f"room {r.room}: decode dp_rank {req.decode_rank} holds {req.reused_pages} pages of "
                f"another prefix (key {req.reused_key[:16]}...) than this prompt's: prefix hash "
                "mismatch")
    return None
