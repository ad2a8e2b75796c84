"""Request items: what every HTTP route (native or OpenAI) turns a body into.

A body holds one or more prompts, each sampled `n` times; every (prompt, sample) becomes one
`RequestItem` with its own rid, sampling params and PD fields. Field checks live here too:
unknown fields are ignored, a known field with a wrong type or value is a BadRequest, and a
known field asking for what this server does not do is a BadRequest saying so
(core.sampling.unsupported): never accepted and ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..core.errors import BadRequest
from ..core.logprobs import PromptLogprobs
from ..core.messages import PDParams
from ..core.pd_vocab import DEFAULT_BOOTSTRAP_PORT, MAX_ROOM
from ..core.sampling import SamplingParams
from .resume import Resume, check_resumable, continue_sampling, parse_resume
from .text_options import TextOptions


@dataclass(frozen=True)
class RequestItem:
    index: int  # position in the reply (prompt * n + sample)
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    max_new_tokens_given: bool  # False: the default may be shortened to fit the context
    return_logprob: bool = False
    routed_dp_rank: int | None = None
    pd: PDParams = PDParams()
    top_logprobs: int = 0  # alternatives with every returned logprob
    prompt_logprobs: PromptLogprobs = PromptLogprobs.WITH_RETURN_LOGPROB
    resume: Resume | None = None  # a migrated answer: input_ids end with resume.ids (server/resume.py)
    text: TextOptions = TextOptions()  # special tokens and stop strings in the text (text_options.py)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def opt_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be a boolean, got {type(v).__name__}")
    return v


def opt_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise BadRequest(f"{key} must be an integer, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{key}={v} is out of range [{lo}, {hi}]")
    return v


def opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"{key} must be a string, got {type(v).__name__}")
    return v


def per_item(body: dict, key: str, total: int, check, spread=None) -> list:
    """A field given once or as a list of `total` values -> `total` checked values.
    `spread(value, k)` derives item k's value from a single one (default: the same value)."""
    v = body.get(key)
    if isinstance(v, list):
        if len(v) != total:
            raise BadRequest(f"{key} has {len(v)} entries but the request has {total} items "
                             "(one per prompt and per sample)")
        return [check(key, x) for x in v]
    one = check(key, v)
    return [one if spread is None or one is None else spread(one, k) for k in range(total)]


def _int_or_none(lo: int, hi: int):
    def check(key: str, v: Any) -> int | None:
        if v is None:
            return None
        if not is_int(v):
            raise BadRequest(f"{key} must be an integer or null, got {type(v).__name__}")
        if not lo <= v < hi:
            raise BadRequest(f"{key}={v} is out of range [{lo}, {hi})")
        return v
    return check


def _host(key: str, v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"{key} must be a string or null, got {type(v).__name__}")
    return v


def pd_fields(body: dict, total: int) -> list[PDParams]:
    hosts = per_item(body, "bootstrap_host", total, _host)
    ports = per_item(body, "bootstrap_port", total, _int_or_none(1, 65536))
    rooms = per_item(body, "bootstrap_room", total, _int_or_none(0, MAX_ROOM),
                     spread=lambda room, k: (room + k) % MAX_ROOM)
    pins = per_item(body, "disagg_prefill_dp_rank", total, _int_or_none(0, 1 << 16))
    return [PDParams(h, DEFAULT_BOOTSTRAP_PORT if p is None else p, r, q)
            for h, p, r, q in zip(hosts, ports, rooms, pins)]


def routed_ranks(body: dict, total: int) -> list[int | None]:
    key = "routed_dp_rank" if body.get("routed_dp_rank") is not None else "data_parallel_rank"
    return per_item(body, key, total, _int_or_none(0, 1 << 16))


def rids(body: dict, num_prompts: int, n: int) -> list[str]:
    total = num_prompts * n
    v = body.get("rid")
    if v is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(v, str):
        out = [v] if total == 1 else [f"{v}_{k}" for k in range(total)]
    elif isinstance(v, list) and all(isinstance(x, str) for x in v):
        if len(v) == total:
            out = list(v)
        elif len(v) == num_prompts:
            out = [v[i] if n == 1 else f"{v[i]}_{j}" for i in range(num_prompts) for j in range(n)]
        else:
            raise BadRequest(f"rid has {len(v)} entries but the request has {num_prompts} prompts")
    else:
        raise BadRequest("rid must be a string or a list of strings")
    if any(not r for r in out) or len(set(out)) != len(out):
        raise BadRequest("rid values must be non-empty and unique")
    return out


def check_token_ids(ids: Any, key: str) -> list[int]:
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise BadRequest(f"{key} must be a list of integers")
    if not ids:
        raise BadRequest(f"{key} must not be empty")
    return ids


def build_items(body: dict, prompts: list[list[int]], sampling: list[SamplingParams],
                max_new_given: list[bool], return_logprob: bool, top_logprobs: int = 0,
                prompt_logprobs: PromptLogprobs = PromptLogprobs.WITH_RETURN_LOGPROB,
                text: list[TextOptions] | None = None) -> list[RequestItem]:
    """Expand prompts x n into items, prompt-major, with rids and PD fields from the body;
    `text`: each prompt's text options (default: TextOptions())."""
    n = sampling[0].n
    if any(s.n != n for s in sampling):
        raise BadRequest("every prompt of one request must use the same n")
    total = len(prompts) * n
    ids_ = rids(body, len(prompts), n)
    pds = pd_fields(body, total)
    routed = routed_ranks(body, total)
    resume = parse_resume(body)
    if resume is not None:
        check_resumable(len(prompts), n)
        prompts = [list(prompts[0]) + list(resume.ids)]
        sampling = [continue_sampling(sampling[0], resume)]
    text = text or [TextOptions()] * len(prompts)
    items = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            k = i * n + j
            sp = sampling[i].replace(n=1)
            if j and sp.seed is not None:
                sp = sp.replace(seed=(sp.seed + j) % MAX_ROOM)
            items.append(RequestItem(k, ids_[k], prompt, sp, max_new_given[i], return_logprob,
                                     routed[k], pds[k], top_logprobs, prompt_logprobs, resume, text[i]))
    return items
