"""What a request asks of logprobs, in the terms every layer shares (stdlib only).

Every logprob the engine returns is of the model's raw distribution: log_softmax of its logits
before logit processors, temperature and top-k/p (vLLM's default; see engine/logprobs.py).
"""

from __future__ import annotations

import enum

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs and completions logprobs

# (token id, logprob) pairs of one position, most likely first
TopLogprobs = list[tuple[int, float]]


class PromptLogprobs(enum.Enum):
    """Whether a request with return_logprob also gets its prompt tokens' logprobs, and which
    server returns them in PD."""

    # SGLang's return_logprob: computed where the prompt is computed; a PD decode leaves them to
    # the prefill's reply, which the router puts in front of the decode's (SGLang's contract)
    WITH_RETURN_LOGPROB = "with_return_logprob"
    # OpenAI logprobs without echo: the sampled tokens' only (no pass over the prompt's logits,
    # so the prefix cache stays usable)
    NONE = "none"
    # OpenAI echo with logprobs: returned by the server that answers, a PD decode included (they
    # come to it in the KvDone)
    IN_REPLY = "in_reply"
