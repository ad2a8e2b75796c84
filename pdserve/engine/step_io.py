"""What goes into the engine and what comes out of it: a request, one step's output per
request, the pool's counters. Plain data with no torch, so the worker's loop and roles (and the
tests' fake engines, tests/harness/fake_engine.py) use the same types without loading a model."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.logprobs import PromptLogprobs, TopLogprobs
from ..core.sampling import SamplingParams
from .prefix_cache import CacheCounters


@dataclass(frozen=True)
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False  # the sampled tokens' logprobs (and the prompt's, see prompt_logprobs)
    hold_kv: bool = False  # keep the KV pages after finishing, until release(rid)
    top_logprobs: int = 0  # with every returned logprob, this many most likely alternatives
    prompt_logprobs: PromptLogprobs = PromptLogprobs.WITH_RETURN_LOGPROB

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position is computed (no prefix-cache lookup) for its logprob."""
        return self.return_logprob and self.prompt_logprobs is not PromptLogprobs.NONE


@dataclass
class StepOutput:
    rid: str
    token_id: int | None
    logprob: float | None = None
    finished: bool = False
    finish_reason: dict | None = None
    input_logprobs: list[float | None] | None = None  # with the first token, when asked
    top_logprobs: TopLogprobs | None = None  # the token's alternatives, when asked
    input_top_logprobs: list[TopLogprobs | None] | None = None  # per prompt position, with input_logprobs
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    held_pages: list[int] | None = None  # finished hold_kv requests: their KV pages


@dataclass(frozen=True)
class EngineStats:
    total_pages: int
    free_pages: int
    cached_pages: int
    running: int
    waiting: int
    held_pages: int
    cache: CacheCounters
