"""Fields of vLLM's and SGLang's APIs that this server knows but does not do: a request that asks
for one gets a 400 naming it (README, "API policy"), never a 200 that ignored it. The no-op
values (null, false, [], {}, SGLang's logprob_start_len -1 / 0) are taken.
"""

from __future__ import annotations

from ..core.sampling import unsupported

# field -> why, on /v1/completions and /v1/chat/completions (vLLM's and SGLang's extras)
OPENAI_REFUSED = {
    "use_beam_search": " (no beam search)",
    "allowed_token_ids": " (use logit_bias)",
    "bad_words": " (use logit_bias)",
    "prompt_logprobs": " (completions echo with logprobs returns the prompt's logprobs)",
    "return_hidden_states": " (no hidden states are returned)",
    "lora_path": " (no LoRA adapters)",
    "lora_request": " (no LoRA adapters)",
}
# field -> why, on SGLang's /generate (top level)
GENERATE_REFUSED = {
    "return_hidden_states": " (no hidden states are returned)",
    "token_ids_logprob": " (return_logprob gives the sampled tokens', top_logprobs_num the most likely)",
    "lora_path": " (no LoRA adapters)",
    "custom_logit_processor": " (no custom logit processors)",
}
# logprob_start_len: we always return every prompt position's logprob (the first is null), which is
# SGLang's 0; -1 is its default ("none asked for"), so only those two are taken
LOGPROB_START_LENS = (-1, 0)


def _asks(v) -> bool:
    return v is not None and v is not False and v != [] and v != {}


def refuse_openai(body: dict) -> None:
    for key, why in OPENAI_REFUSED.items():
        if _asks(body.get(key)):
            raise unsupported(key, why)


def refuse_generate(body: dict) -> None:
    for key, why in GENERATE_REFUSED.items():
        if _asks(body.get(key)):
            raise unsupported(key, why)
    start = body.get("logprob_start_len")
    if start is not None and start not in LOGPROB_START_LENS:
        raise unsupported(f"logprob_start_len={start!r}", " (prompt logprobs start at 0: use 0 or -1)")
