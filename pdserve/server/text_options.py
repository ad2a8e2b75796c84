"""How one item's output ids become its text: special tokens skipped or kept, and whether a
matched stop string or stop token stays at the end. Read by the front only (request_state.py);
workers never see it, so a PD pair's decode front, which builds the client's text, applies it.

SGLang takes `skip_special_tokens`, `spaces_between_special_tokens` and `no_stop_trim` in
/generate's sampling_params and at the top of its OpenAI bodies; vLLM takes the first two and
`include_stop_str_in_output` at the top of its OpenAI bodies. Their stop rules differ in one
detail, kept here: vLLM cuts the text right after the stop string, SGLang keeps everything the
matching token decoded to (the stop string and what followed it in that token).
`spaces_between_special_tokens` only changes HF's slow (Python) tokenizers; the `tokenizers`
decoder this server uses (tokenizer.json, as HF fast tokenizers, vLLM and SGLang use it) never
puts spaces around special tokens, which is what `false` asks for and what `true` gives there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..core.errors import BadRequest


class StopInText(str, enum.Enum):
    TRIM = "trim"  # the default: the text ends before the stop string; a stop token shows nothing
    THROUGH_STOP = "through_stop"  # vLLM include_stop_str_in_output: through the stop string; token's text kept
    WHOLE_TOKEN = "whole_token"  # SGLang no_stop_trim: all text through the matching token; token's text kept


@dataclass(frozen=True)
class TextOptions:
    skip_special_tokens: bool = True
    stop_in_text: StopInText = StopInText.TRIM


def _flag(obj: dict, key: str, label: str) -> bool | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{label}{key} must be a boolean, got {type(v).__name__}")
    return v


def _options(obj: dict, label: str, vllm_stop: bool) -> TextOptions:
    skip = _flag(obj, "skip_special_tokens", label)
    _flag(obj, "spaces_between_special_tokens", label)  # no effect with tokenizer.json: module docstring
    keep_sglang = _flag(obj, "no_stop_trim", label)
    keep_vllm = _flag(obj, "include_stop_str_in_output", label) if vllm_stop else None
    if keep_sglang:  # both true: SGLang's reading, which keeps the most
        stop = StopInText.WHOLE_TOKEN
    elif keep_vllm:
        stop = StopInText.THROUGH_STOP
    else:
        stop = StopInText.TRIM
    return TextOptions(True if skip is None else skip, stop)


def sglang_text_options(sampling_params: object, label: str = "sampling_params.") -> TextOptions:
    """/generate: the keys of one sampling_params object (a non-object is refused elsewhere)."""
    if not isinstance(sampling_params, dict):
        return TextOptions()
    return _options(sampling_params, label, vllm_stop=False)


def openai_text_options(body: dict) -> TextOptions:
    """/v1/completions and /v1/chat/completions: top-level fields, SGLang's and vLLM's names."""
    return _options(body, "", vllm_stop=True)
