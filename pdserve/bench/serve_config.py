"""The `pdserve bench serve` configuration: one frozen dataclass whose fields become the CLI flags,
checked when it is built so a bad flag fails before any request goes out."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .arrivals import ArrivalKind
from .backends import BACKENDS
from .metrics import parse_slo

DEFAULT_NUM_PROMPTS = 1000
# Workloads that measure prefix-cache reuse; their request count comes from their own flags.
CACHE_DATASETS = ("shared-prefix", "multi-turn")


def _opt(help: str, choices: tuple | None = None, **kw):
    return field(metadata={"help": help, "choices": choices}, **kw)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; the CLI flags are generated from these fields."""

    url: str = _opt("server base URL", default="http://127.0.0.1:30000")
    backend: str = _opt("server API", tuple(BACKENDS), default="pdserve")
    model: str = _opt("model name for OpenAI APIs (default: first of /v1/models)", default="")
    dataset: str = _opt("prompt source: random words, a file, N prefixes x M suffixes, or "
                        "multi-turn chats resending their history",
                        ("random", "file", *CACHE_DATASETS), default="random")
    dataset_path: str = _opt("JSON/JSONL file for --dataset file", default="")
    num_prompts: int = _opt(
        "number of requests; shared-prefix sends prefixes x suffixes and multi-turn conversations x"
        f" turns, so for them leave it at {DEFAULT_NUM_PROMPTS} or give that same count",
        default=DEFAULT_NUM_PROMPTS)
    random_input_len: int = _opt("max prompt tokens of random prompts", default=1024)
    random_output_len: int = _opt(
        "max output tokens of random prompts; the output tokens of every shared-prefix request "
        "and multi-turn turn", default=128)
    random_range_ratio: float = _opt(
        "lengths are uniform in [len * ratio, len]; 1.0 = fixed lengths", default=1.0)
    file_output_len: int = _opt("override output tokens of file prompts (0 = from data)", default=0)
    prefix_num_prefixes: int = _opt(
        "shared-prefix: prefixes, each with its own first word (none shares with another)", default=4)
    prefix_suffixes_per_prefix: int = _opt("shared-prefix: prompts per prefix, each a new suffix",
                                           default=8)
    prefix_len: int = _opt("shared-prefix: tokens of each prefix", default=1024)
    suffix_len: int = _opt("shared-prefix: tokens of each suffix", default=32)
    multi_turn_conversations: int = _opt("multi-turn: conversations", default=4)
    multi_turn_turns: int = _opt("multi-turn: turns (requests) per conversation", default=4)
    multi_turn_first_len: int = _opt("multi-turn: tokens of the first user message", default=512)
    multi_turn_question_len: int = _opt("multi-turn: tokens of each later user message", default=32)
    multi_turn_system_len: int = _opt("multi-turn: tokens of a system prompt every conversation "
                                      "starts with (0 = none)", default=0)
    tokenizer: str = _opt("local tokenizer.json or its dir for token counts (default: words)",
                          default="")
    seed: int = _opt("seed for prompts and arrivals", default=1)
    request_rate: float = _opt("requests per second (inf = all at once); multi-turn: conversation "
                               "starts per second, later turns follow their previous one",
                               default=math.inf)
    arrival: str = _opt("arrival process at --request-rate", tuple(k.value for k in ArrivalKind),
                        default="poisson")
    max_concurrency: int = _opt("max requests in flight (0 = no cap); multi-turn: max "
                                "conversations under way (each has one request in flight)", default=0)
    temperature: float = _opt("sampling temperature", default=0.0)
    disable_ignore_eos: bool = _opt("let the model stop at EOS (output lengths vary)", default=False)
    slo: str = _opt("goodput SLOs, e.g. ttft_ms=500,tpot_ms=50 (keys: ttft_ms tpot_ms itl_ms e2e_ms)",
                    default="")
    warmup_requests: int = _opt("requests sent (and checked) before timing starts; for the "
                                "prefix-cache datasets a random prompt, not one of theirs", default=1)
    flush_cache: bool = _opt("empty the server's prefix cache after the warmup, before timing "
                             "(POST /flush_cache as SGLang and pdserve; /reset_prefix_cache on vLLM)",
                             default=False)
    request_timeout: float = _opt("seconds one request may take before it counts as failed",
                                  default=600.0)
    api_key: str = _opt("Bearer token", default="")
    extra_body: str = _opt("JSON object merged into every request body", default="")
    output: str = _opt("write config, summary and per-request records to this JSON file",
                       default="")
    disable_tqdm: bool = _opt("no progress bar", default=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.dataset == "file" and not self.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        if self.num_prompts < 1 or self.max_concurrency < 0 or self.warmup_requests < 0:
            raise ValueError("num_prompts must be >= 1, max_concurrency and warmup_requests >= 0")
        if not self.request_rate > 0 or not self.request_timeout > 0:
            raise ValueError("request_rate and request_timeout must be > 0")
        self._check_cache_dataset()
        ArrivalKind(self.arrival)
        parse_slo(self.slo)
        self.extra_body_dict()

    def _check_cache_dataset(self) -> None:
        sizes = {"shared-prefix": ("prefix_num_prefixes", "prefix_suffixes_per_prefix",
                                   "prefix_len", "suffix_len"),
                 "multi-turn": ("multi_turn_conversations", "multi_turn_turns",
                                "multi_turn_first_len", "multi_turn_question_len")}.get(self.dataset, ())
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.multi_turn_system_len < 0:
            raise ValueError("--multi-turn-system-len must be >= 0")
        planned = self.planned_requests()
        if self.dataset in CACHE_DATASETS and self.num_prompts not in (DEFAULT_NUM_PROMPTS, planned):
            raise ValueError(f"--dataset {self.dataset} sends {planned} requests (set by its own "
                             f"flags); --num-prompts {self.num_prompts} disagrees")

    def planned_requests(self) -> int:
        """How many requests the run means to send."""
        if self.dataset == "shared-prefix":
            return self.prefix_num_prefixes * self.prefix_suffixes_per_prefix
        if self.dataset == "multi-turn":
            return self.multi_turn_conversations * self.multi_turn_turns
        return self.num_prompts

    def slo_targets(self) -> dict[str, float]:
        return parse_slo(self.slo)

    def extra_body_dict(self) -> dict:
        if not self.extra_body:
            return {}
        body = json.loads(self.extra_body)
        if not isinstance(body, dict):
            raise ValueError("--extra-body must be a JSON object")
        return body
