"""OpenAI `/v1/completions` and `/v1/chat/completions` bodies -> request items.

Sampling fields map onto SamplingParams (SGLang's extras top_k, min_p, stop_token_ids,
ignore_eos, repetition_penalty too, vLLM's min_tokens); the PD fields and `rid` may ride in the
same body. Unknown fields are ignored; a standard field asking for what this server does not do
(structured output, tools, top logprobs, echo, suffix, best_of, ...) is a 400 naming it, never
accepted and ignored (`refuse_unsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import BadRequest
from ..core.sampling import SamplingParams, unsupported
from .protocol import RequestItem, build_items, check_token_ids, is_int, opt_bool, opt_int, opt_str
from .tokenizer import ServerTokenizer

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "seed", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
RENAMED_SAMPLING_KEYS = {"min_tokens": "min_new_tokens"}  # OpenAI/vLLM name -> SamplingParams name
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# structured output (vLLM's guided_* and structured_outputs, SGLang's OpenAI extras): not done here
STRUCTURED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                   "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class OpenAICall:
    items: list[RequestItem]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str | None


def _sampling(body: dict, max_tokens: int | None, default_max: int | None,
              max_name: str = "max_tokens") -> tuple[SamplingParams, bool]:
    raw = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    raw.update({ours: body[k] for k, ours in RENAMED_SAMPLING_KEYS.items() if body.get(k) is not None})
    given = max_tokens is not None
    mx = max_tokens if given else default_max
    if mx is not None:
        raw["max_new_tokens"] = mx
    elif "max_new_tokens" not in raw:
        raw["max_new_tokens"] = 1 << 20  # "as many as fit": cut to the context by Generator.check
    names = {ours: k for k, ours in RENAMED_SAMPLING_KEYS.items()} | {"max_new_tokens": max_name}
    return SamplingParams.from_json(raw, prefix="", names=names), given


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
    for key in STRUCTURED_KEYS:
        if body.get(key) is not None:
            raise unsupported(key, " (no structured output / constrained decoding)")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise BadRequest("response_format must be an object with a string type")
        if rf["type"] != "text":
            raise unsupported(f"response_format type {rf['type']!r}", " (only \"text\"; no structured output)")
    best_of = opt_int(body, "best_of", 1)
    n = opt_int(body, "n", 1)
    if best_of is not None and best_of != (n or 1):
        raise unsupported(f"best_of={best_of}", " (only best_of = n: every sample is returned)")
    if chat:
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list")
        if tools:
            raise unsupported("tools", " (no tool calling)")
        for key in ("tool_choice", "function_call"):
            choice = body.get(key)
            if choice is not None and choice != "none":
                raise unsupported(f"{key}={choice!r}", " (no tool calling; only \"none\")")
        if body.get("functions"):
            raise unsupported("functions", " (no tool calling)")
        if body.get("chat_template") is not None:
            raise unsupported("chat_template", " per request (the model's own template is used; "
                              "chat_template_kwargs are passed to it)")
        if (opt_int(body, "top_logprobs", 0, 20) or 0) > 0:
            raise unsupported("top_logprobs > 0", " (only the sampled tokens' logprobs are returned)")
    else:
        if opt_bool(body, "echo"):
            raise unsupported("echo")
        suffix = opt_str(body, "suffix")
        if suffix:
            raise unsupported("suffix", " (no insertion)")
        if (opt_int(body, "logprobs", 0, 20) or 0) > 0:
            raise unsupported("logprobs > 0", " (top alternatives are not returned; logprobs=0 gives "
                              "the sampled tokens' logprobs)")


def _call(body: dict, prompts: list[list[int]], sampling: SamplingParams, given: bool,
          logprobs: bool) -> OpenAICall:
    items = build_items(body, prompts, [sampling] * len(prompts), [given] * len(prompts), logprobs)
    stream, include_usage = _stream_flags(body)
    return OpenAICall(items, sampling.n, stream, include_usage, logprobs, opt_str(body, "model"))


def parse_completion(body: dict, tok: ServerTokenizer) -> OpenAICall:
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
    sampling, given = _sampling(body, max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    logprobs = opt_int(body, "logprobs", 0, 20)
    return _call(body, prompts, sampling, given, logprobs is not None)


def _content_text(content, k: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{k}].content: only text parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)
    raise BadRequest(f"messages[{k}].content must be a string or a list of parts")


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{k}] must be an object with a string role")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), k)
        out.append(msg)
    return out


def parse_chat(body: dict, tok: ServerTokenizer) -> OpenAICall:
    messages = chat_messages(body)
    refuse_unsupported(body, chat=True)
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    cont = opt_bool(body, "continue_final_message")
    add_gen = opt_bool(body, "add_generation_prompt", default=not cont)
    text = tok.apply_chat_template(messages, add_gen and not cont, None, extra)
    if cont:  # end the prompt right after the last message's content
        last = messages[-1]["content"]
        cut = text.rfind(last) if last else -1
        if cut >= 0:
            text = text[:cut + len(last)]
    prompt = tok.encode(text, add_special_tokens=False)
    if not prompt:
        raise BadRequest("the chat prompt is empty")
    max_name = "max_completion_tokens"
    max_tokens = opt_int(body, max_name, 0)
    if max_tokens is None:
        max_name = "max_tokens"
        max_tokens = opt_int(body, max_name, 0)
    sampling, given = _sampling(body, max_tokens, None, max_name)
    logprobs = opt_bool(body, "logprobs")
    return _call(body, [prompt], sampling, given, logprobs)
