"""Engine-side request state. The request and what a step hands back are plain data in
step_io.py (no torch); they are imported here too, where the engine's users found them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..core.logprobs import TopLogprobs
from .sampler import TokenHistory
from .step_io import EngineRequest, StepOutput  # noqa: F401  (re-exported)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    req: EngineRequest
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    status: SeqStatus = SeqStatus.WAITING
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    sent_input_logprobs: bool = False
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages
    offered: int = 0  # leading pages already offered to the prefix cache
    cached_tokens: int | None = None  # prompt tokens reused from the cache, set when first scheduled
    history: TokenHistory | None = None  # for logit processors (penalties, min_new_tokens), else None
    matcher: object | None = None  # grammar.matcher.SeqMatcher of a structured output, else None

    def __post_init__(self):
        if self.history is None:
            self.history = TokenHistory.for_params(self.req.prompt_ids, self.req.sampling)

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        if self.history is not None:
            self.history.append(token)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.req.prompt_ids)
        return self.req.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.req.prompt_ids)
        if end <= n:
            return self.req.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.req.prompt_ids[start:] + self.output_ids[:end - n]
