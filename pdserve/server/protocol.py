"""Request items, and SGLang's native `POST /generate`: body -> request items, progress -> reply JSON.

Items, what every HTTP route (native or OpenAI, openai_protocol.py) turns a body into: a body
holds one or more prompts, each sampled `n` times; every (prompt, sample) becomes one
`RequestItem` with its own rid, sampling params and PD fields. Field checks live here too:
unknown fields are ignored, a known field with a wrong type or value is a BadRequest, and a
known field asking for what this server does not do is a BadRequest saying so
(core.sampling.unsupported): never accepted and ignored.

The native route (`parse_generate`, `item_reply`): `sampling_params` takes SGLang's names
(SamplingParams.from_json): penalties, min_new_tokens and logit_bias work; `json_schema` (JSON
text), `regex` and `ebnf` constrain the output (one of them; a bad one is a 400 with the grammar
library's message); structural_tag and stop_regex are refused with a 400 naming the field;
skip_special_tokens, spaces_between_special_tokens and no_stop_trim shape the text
(server/text_options.py). `return_logprob` gives the prompt's and the sampled tokens' logprobs;
`top_logprobs_num` (up to 20) adds each position's most likely alternatives (meta_info
input_top_logprobs / output_top_logprobs, entries [logprob, token id, text or null]).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import BadRequest
from ..core.logprobs import MAX_TOP_LOGPROBS, PromptLogprobs
from ..core.messages import PDParams
from ..core.pd_vocab import DEFAULT_BOOTSTRAP_PORT, MAX_ROOM
from ..core.sampling import SamplingParams
from .api_options import ApiOptions
from .refused_fields import refuse_generate
from .resume import Resume, check_resumable, continue_sampling, parse_resume
from .sampling_defaults import with_defaults
from .structured_outputs import check_sampling
from .text_options import TextOptions, sglang_text_options
from .tokenizer import ServerTokenizer

if TYPE_CHECKING:  # request_state.py reads RequestItem from here
    from .request_state import ItemProgress


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


# ---- SGLang's native /generate: body -> items, progress -> reply

@dataclass(frozen=True)
class NativeCall:
    items: list[RequestItem]
    stream: bool
    batched: bool  # reply with a list
    text_in_logprobs: bool
    return_timeline: bool = False  # add meta_info["timeline"] to each finished item


def _prompts(body: dict, tok: ServerTokenizer) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("give either text or input_ids, not both")
    if text is None and ids is None:
        raise BadRequest("the request needs text or input_ids")
    if text is not None:
        if isinstance(text, str):
            texts, batched = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, batched = text, True
        else:
            raise BadRequest("text must be a string or a non-empty list of strings")
        if any(t == "" for t in texts):
            raise BadRequest("text must not be empty")
        return [tok.encode(t) for t in texts], batched
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return [check_token_ids(x, f"input_ids[{i}]") for i, x in enumerate(ids)], True
    return [check_token_ids(ids, "input_ids")], False


def _sampling_seed(sp):
    """SGLang's sampling_params.sampling_seed is the per-request seed (our `seed`)."""
    if not isinstance(sp, dict) or sp.get("sampling_seed") is None:
        return sp
    seed, other = sp["sampling_seed"], sp.get("seed")
    if other is not None and other != seed:
        raise BadRequest(f"sampling_params.sampling_seed={seed!r} and seed={other!r} disagree; give one")
    return {**{k: v for k, v in sp.items() if k != "sampling_seed"}, "seed": seed}


def parse_generate(body: dict, tok: ServerTokenizer, opts: ApiOptions | None = None) -> NativeCall:
    """`opts`: the server's sampling defaults (generation_config)."""
    prompts, batched = _prompts(body, tok)
    refuse_generate(body)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise BadRequest(f"sampling_params has {len(sp)} entries for {len(prompts)} prompts")
        raw = sp
    else:
        raw = [sp] * len(prompts)
    defaults = (opts or ApiOptions()).sampling_defaults
    raw = [_sampling_seed(x) for x in raw]
    sampling = [SamplingParams.from_json(with_defaults(x, defaults)) for x in raw]
    for sp in sampling:
        check_sampling(sp)  # a bad json_schema / regex / ebnf is a 400 here, before any worker
    given = [isinstance(x, dict) and x.get("max_new_tokens") is not None for x in raw]
    return_logprob = opt_bool(body, "return_logprob")
    top = opt_int(body, "top_logprobs_num", 0, MAX_TOP_LOGPROBS) or 0
    if top and not return_logprob:
        raise BadRequest("top_logprobs_num needs return_logprob: true")
    text = [sglang_text_options(x) for x in raw]
    items = build_items(body, prompts, sampling, given, return_logprob, top, text=text)
    return NativeCall(items, opt_bool(body, "stream"), batched or len(items) > 1,
                      opt_bool(body, "return_text_in_logprobs"), opt_bool(body, "return_timeline"))


def _logprob_list(logprobs, ids, tok: ServerTokenizer | None) -> list:
    return [[lp, t, tok.token_text(t) if tok else None] for lp, t in zip(logprobs, ids)]


def _top_list(tops, tok: ServerTokenizer | None) -> list:
    return [None if alts is None else _logprob_list([lp for _, lp in alts], [t for t, _ in alts], tok)
            for alts in tops]


def item_reply(prog: ItemProgress, tok: ServerTokenizer, text_in_logprobs: bool,
               index: int | None = None, timeline: bool = False) -> dict:
    """The reply for one item (final or a streamed snapshot with the text safe to show so far);
    `timeline` adds meta_info["timeline"] once the item finished."""
    meta = dict(prog.meta)
    meta.update({
        "id": prog.rid,
        "prompt_tokens": prog.prompt_tokens,
        "cached_tokens": prog.cached_tokens,
        "completion_tokens": len(prog.output_ids),
        "finish_reason": prog.finish_reason,
        "e2e_latency": round(prog.e2e_latency(), 6),
    })
    if prog.item.return_logprob:
        name_tok = tok if text_in_logprobs else None
        inp = prog.input_logprobs or []
        meta["input_token_logprobs"] = _logprob_list(inp, prog.item.input_ids, name_tok)
        meta["output_token_logprobs"] = _logprob_list(prog.output_logprobs, prog.output_ids, name_tok)
        if prog.item.top_logprobs:
            meta["input_top_logprobs"] = _top_list(prog.input_top_logprobs or [], name_tok)
            meta["output_top_logprobs"] = _top_list(prog.output_top_logprobs, name_tok)
    if timeline and prog.finished:
        meta["timeline"] = prog.timeline()
    out: dict[str, Any] = {"text": prog.visible_text(), "output_ids": list(prog.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out
