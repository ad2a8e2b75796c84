"""OpenAI `/v1/completions` and `/v1/chat/completions` bodies -> request items.

Sampling fields map onto SamplingParams (SGLang's extras top_k, min_p, stop_token_ids,
ignore_eos, repetition_penalty too, vLLM's min_tokens); the PD fields and `rid` may ride in the
same body. Unknown fields are ignored; a standard field asking for what this server does not do
(suffix, best_of, server/refused_fields.py, ...) is a 400 naming it, never accepted and ignored
(`refuse_unsupported`). Structured outputs (OpenAI `response_format` json_object / json_schema,
vLLM `structured_outputs` and `guided_*`, SGLang's `json_schema` / `regex` / `ebnf`) become the
request's grammar, checked here (server/structured_outputs.py; a bad one is a 400).
Logprobs: chat `logprobs` + `top_logprobs` (0..20), completions `logprobs` (0..20) and `echo`
(the prompt back, with its tokens' logprobs when `logprobs` is set). skip_special_tokens,
spaces_between_special_tokens, SGLang's no_stop_trim and vLLM's include_stop_str_in_output
shape the text (server/text_options.py).
Chat messages, tools and tool_choice: server/chat_request.py; generation_config defaults fill
the sampling fields a body leaves unset (server/sampling_defaults.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.errors import BadRequest
from ..core.logprobs import MAX_TOP_LOGPROBS, PromptLogprobs
from ..core.sampling import SamplingParams, unsupported
from .api_options import ApiOptions
from .chat_output import ChatShape
from .chat_request import parse_chat_request
from .protocol import RequestItem, build_items, check_token_ids, is_int, opt_bool, opt_int, opt_str
from .refused_fields import refuse_openai
from .sampling_defaults import with_defaults
from .structured_outputs import parse_structured, with_grammar
from .text_options import openai_text_options
from .tokenizer import ServerTokenizer

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "seed", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
RENAMED_SAMPLING_KEYS = {"min_tokens": "min_new_tokens"}  # OpenAI/vLLM name -> SamplingParams name
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class OpenAICall:
    items: list[RequestItem]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str | None
    top_logprobs: int = 0  # alternatives per returned logprob (chat top_logprobs, completions logprobs)
    echo_texts: tuple[str, ...] | None = None  # completions echo: each prompt's text, put before its output
    shape: ChatShape = ChatShape()  # chat: how answers are read back (reasoning, tool calls)


def _sampling(body: dict, max_tokens: int | None, default_max: int | None,
              max_name: str = "max_tokens", defaults: dict | None = None) -> tuple[SamplingParams, bool]:
    """`defaults`: generation_config's values for the fields the body leaves unset."""
    defaults = defaults or {}
    raw = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    raw.update({ours: body[k] for k, ours in RENAMED_SAMPLING_KEYS.items() if body.get(k) is not None})
    raw = with_defaults(raw, {k: v for k, v in defaults.items() if k != "max_new_tokens"})
    given = max_tokens is not None
    mx = max_tokens if given else defaults.get("max_new_tokens", default_max)
    if mx is not None:
        raw["max_new_tokens"] = mx
    elif "max_new_tokens" not in raw:
        raw["max_new_tokens"] = 1 << 20  # "as many as fit": cut to the context by Generator.check
    names = {ours: k for k, ours in RENAMED_SAMPLING_KEYS.items()} | {"max_new_tokens": max_name}
    sampling = SamplingParams.from_json(raw, prefix="", names=names)
    return with_grammar(sampling, parse_structured(body)), given  # structured_outputs.py


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = opt_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("stream_options must be an object")
    if so and opt_bool(so, "continuous_usage_stats"):
        raise unsupported("stream_options.continuous_usage_stats", " (usage comes in the last chunk, "
                          "with stream_options.include_usage)")
    return stream, bool(so and opt_bool(so, "include_usage"))


def refuse_unsupported(body: dict, chat: bool) -> None:
    """400 for every standard field whose value asks for what this server does not do; the
    defaults and the no-op values (response_format text, tools [], tool_choice "none",
    top_logprobs 0, best_of = n, ...) are accepted."""
    best_of = opt_int(body, "best_of", 1)
    n = opt_int(body, "n", 1)
    if best_of is not None and best_of != (n or 1):
        raise unsupported(f"best_of={best_of}", " (only best_of = n: every sample is returned)")
    refuse_openai(body)
    if chat:  # tools and tool_choice: server/tools.py
        if body.get("chat_template") is not None:
            raise unsupported("chat_template", " per request (the model's own template is used; "
                              "chat_template_kwargs are passed to it)")
        if (opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0) > 0 and not opt_bool(body, "logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true")
    else:
        suffix = opt_str(body, "suffix")
        if suffix:
            raise unsupported("suffix", " (no insertion)")


def _call(body: dict, prompts: list[list[int]], sampling: SamplingParams, given: bool,
          logprobs: bool, top: int = 0, echo_texts: tuple[str, ...] | None = None) -> OpenAICall:
    prompt_lp = PromptLogprobs.IN_REPLY if echo_texts is not None and logprobs else PromptLogprobs.NONE
    items = build_items(body, prompts, [sampling] * len(prompts), [given] * len(prompts), logprobs, top,
                        prompt_lp, [openai_text_options(body)] * len(prompts))
    stream, include_usage = _stream_flags(body)
    return OpenAICall(items, sampling.n, stream, include_usage, logprobs, opt_str(body, "model"), top,
                      echo_texts)


def parse_completion(body: dict, tok: ServerTokenizer, opts: ApiOptions | None = None) -> OpenAICall:
    p = body.get("prompt")
    if isinstance(p, str):
        texts: list | None = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        texts = p
    else:
        texts = None
    if texts is not None:
        if any(t == "" for t in texts):
            raise BadRequest("prompt must not be empty")
        prompts = [tok.encode(t) for t in texts]
    elif isinstance(p, list) and p and all(is_int(x) for x in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts = [check_token_ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
    else:
        raise BadRequest("prompt must be a non-empty string, list of strings, list of token ids, "
                         "or list of token id lists")
    refuse_unsupported(body, chat=False)
    max_tokens = opt_int(body, "max_tokens", 0)
    sampling, given = _sampling(body, max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                defaults=(opts or ApiOptions()).sampling_defaults)
    logprobs = opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = None
    if opt_bool(body, "echo"):  # the prompt as sent; token-id prompts decoded (special tokens kept)
        echo = tuple(texts) if texts is not None else tuple(tok.decode(p, skip_special_tokens=False)
                                                            for p in prompts)
    return _call(body, prompts, sampling, given, logprobs is not None, logprobs or 0, echo)


def parse_chat(body: dict, tok: ServerTokenizer, opts: ApiOptions | None = None) -> OpenAICall:
    opts = opts or ApiOptions()
    chat = parse_chat_request(body, opts)
    refuse_unsupported(body, chat=True)
    prompt = tok.encode(chat.prompt_text(body, tok), add_special_tokens=False)
    if not prompt:
        raise BadRequest("the chat prompt is empty")
    max_name = "max_completion_tokens"
    max_tokens = opt_int(body, max_name, 0)
    if max_tokens is None:
        max_name = "max_tokens"
        max_tokens = opt_int(body, max_name, 0)
    sampling, given = _sampling(body, max_tokens, None, max_name, opts.sampling_defaults)
    sampling = chat.constrain(sampling)
    logprobs = opt_bool(body, "logprobs")
    top = opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    call = _call(body, [prompt], sampling, given, logprobs, top)
    return replace(call, shape=chat.shape_for(sampling))
