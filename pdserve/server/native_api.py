"""SGLang's native `POST /generate`: body -> request items, progress -> reply JSON.

`sampling_params` takes SGLang's names (SamplingParams.from_json): penalties, min_new_tokens and
logit_bias work; `json_schema` (JSON text), `regex` and `ebnf` constrain the output (one of them;
a bad one is a 400 with the grammar library's message); structural_tag and stop_regex are
refused with a 400 naming the field; skip_special_tokens, spaces_between_special_tokens and
no_stop_trim shape the text (server/text_options.py). `return_logprob` gives the prompt's and
the sampled tokens' logprobs; `top_logprobs_num` (up to 20) adds each position's most likely alternatives (meta_info
input_top_logprobs / output_top_logprobs, entries [logprob, token id, text or null]).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import BadRequest
from ..core.logprobs import MAX_TOP_LOGPROBS
from ..core.sampling import SamplingParams
from .api_options import ApiOptions
from .protocol import RequestItem, build_items, check_token_ids, opt_bool, opt_int
from .refused_fields import refuse_generate
from .request_state import ItemProgress
from .sampling_defaults import with_defaults
from .structured_outputs import check_sampling
from .text_options import sglang_text_options
from .tokenizer import ServerTokenizer


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
    out = {"text": prog.visible_text(), "output_ids": list(prog.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out
