"""Control messages between a decode worker and a prefill worker, over the transfer backend.

decode -> prefill  kv_req   {room, dst_pages, prompt_len, layout, endpoint, page_size,
                             kv_dtype, fingerprint, backend, decode_rank}
decode -> prefill  kv_abort {room, reason, decode_rank}
prefill -> decode  kv_done  {room, prefill_rank, first_token, first_logprob, input_logprobs,
                             bytes, transfer_s, started_at, finished_at}
prefill -> decode  kv_fail  {room, prefill_rank, reason}
The kv_done of a room is sent after its page writes, so it arrives after the pages landed.
A prefill answers every kv_abort with kv_done or kv_fail, and sends kv_fail only once no
write of that room can still land: until then the decode keeps the room's pages.
"""

from __future__ import annotations

KV_REQ = "kv_req"
KV_ABORT = "kv_abort"
KV_DONE = "kv_done"
KV_FAIL = "kv_fail"


def compat_problem(local: dict, remote: dict) -> str | None:
    """Why a decode's kv_req cannot be served by this prefill worker, or None.
    Both dicts hold page_size, kv_dtype, fingerprint and backend."""
    for key in ("backend", "page_size", "kv_dtype", "fingerprint"):
        if local.get(key) != remote.get(key):
            return (f"{key} mismatch: prefill has {local.get(key)!r}, decode has {remote.get(key)!r}")
    return None
