"""vLLM's `POST /tokenize` and `POST /detokenize`, with the server's own tokenizer and template.

/tokenize takes `prompt` (add_special_tokens, default true) or chat `messages` (with tools,
add_generation_prompt, continue_final_message, chat_template_kwargs; add_special_tokens default
false, as the template writes them) and `return_token_strs`; it answers {count, max_model_len,
tokens, token_strs}. /detokenize takes `tokens` and answers {prompt}.
"""

from __future__ import annotations

from ..core.errors import BadRequest
from .api_options import ApiOptions
from .chat_request import parse_chat_request
from .protocol import check_token_ids, opt_bool
from .tokenizer import ServerTokenizer


def tokenize(body: dict, tok: ServerTokenizer, opts: ApiOptions, max_model_len: int) -> dict:
    opts.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise BadRequest("give either prompt or messages")
    if body.get("prompt") is not None:
        if not isinstance(body["prompt"], str):
            raise BadRequest("prompt must be a string")
        ids = tok.encode(body["prompt"], add_special_tokens=opt_bool(body, "add_special_tokens", True))
    else:
        text = parse_chat_request(body, opts).prompt_text(body, tok)
        ids = tok.encode(text, add_special_tokens=opt_bool(body, "add_special_tokens", False))
    strs = [tok.token_text(t) for t in ids] if opt_bool(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, tok: ServerTokenizer, opts: ApiOptions) -> dict:
    opts.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    ids = check_token_ids(body.get("tokens"), "tokens")
    bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary [0, {tok.vocab_size})")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}  # as HF decode, which vLLM calls
