"""Sampling parameters: one typed dataclass, validated once at the HTTP edge.

The logit processors (engine/sampler.py) follow vLLM's order and definitions: logit_bias is
added, EOS/stop ids are masked while fewer than min_new_tokens were generated, then
repetition_penalty (prompt + generated tokens: logits > 0 divided by it, others multiplied),
frequency_penalty * count and presence_penalty * [count > 0] (generated tokens only, OpenAI's
definition) are applied, before temperature / top-k / min-p / top-p and before greedy's argmax.
A `grammar` (structured output: JSON schema, regex, choice, EBNF) then sets every token it does
not allow next to -inf, so every sampling mode picks among allowed tokens only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import BadRequest
from .grammar_spec import GrammarSpec, from_sglang_sampling

MAX_NEW_TOKENS_LIMIT = 1 << 20
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range for a logit_bias value
MAX_LOGIT_BIAS_ENTRIES = 1024
# SGLang sampling_params keys that ask for what this server does not do: refused, never ignored
UNSUPPORTED_SAMPLING_KEYS = {"structural_tag": " (json_schema, regex and ebnf are)",
                             "stop_regex": " (stop takes plain strings)"}


def unsupported(field: str, detail: str = "") -> BadRequest:
    """The 400 for a known field this server does not implement (never accept-and-ignore)."""
    return BadRequest(f"{field} is not supported by this server{detail}")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    grammar: GrammarSpec | None = None  # structured output: tokens outside it are masked (core/grammar_spec.py)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """Needs the token history: repetition (prompt + output) or presence/frequency."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Any logit processor applies (otherwise the sampler does no extra work for this row)."""
        return self.penalizes or bool(self.logit_bias) or self.min_new_tokens > 0 or self.grammar is not None

    def replace(self, **kw: Any) -> "SamplingParams":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        return SamplingParams(**d)

    @classmethod
    def from_json(cls, obj: object, prefix: str = "sampling_params.",
                  names: dict[str, str] | None = None) -> "SamplingParams":
        """Parse and validate a JSON `sampling_params` object (SGLang's names); unknown keys are
        ignored, keys naming a feature this server lacks are refused. Errors name a field as
        prefix + names.get(key, key) (the OpenAI routes pass their own spelling)."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise BadRequest("sampling_params must be an object")
        kw: dict[str, Any] = {}

        def label(name: str) -> str:
            return prefix + (names or {}).get(name, name)

        for key, why in UNSUPPORTED_SAMPLING_KEYS.items():
            if obj.get(key) is not None:
                raise unsupported(label(key), why)

        def num(name: str, lo: float | None = None, hi: float | None = None, integer: bool = False,
                nullable: bool = True) -> None:
            if name not in obj or (obj[name] is None and nullable):
                return
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BadRequest(f"{label(name)} must be a number, got {type(v).__name__}")
            if integer:
                if isinstance(v, float) and not v.is_integer():
                    raise BadRequest(f"{label(name)} must be an integer, got {v}")
                v = int(v)
            else:
                v = float(v)
            if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
                raise BadRequest(f"{label(name)}={v} is out of range [{lo}, {hi}]")
            kw[name] = v

        num("max_new_tokens", 0, MAX_NEW_TOKENS_LIMIT, integer=True)
        num("temperature", 0.0, 100.0)
        num("top_p", 0.0, 1.0)
        num("top_k", -1, 1 << 30, integer=True)
        num("min_p", 0.0, 1.0)
        num("n", 1, 64, integer=True)
        num("presence_penalty", *PENALTY_RANGE)
        num("frequency_penalty", *PENALTY_RANGE)
        num("repetition_penalty", 0.0)
        num("min_new_tokens", 0, MAX_NEW_TOKENS_LIMIT, integer=True)
        if "top_p" in kw and kw["top_p"] <= 0.0:
            raise BadRequest(f"{label('top_p')} must be > 0")
        if kw.get("top_k") == 0:
            raise BadRequest(f"{label('top_k')} must be -1 (disabled) or >= 1")
        if kw.get("repetition_penalty", 1.0) <= 0.0:
            raise BadRequest(f"{label('repetition_penalty')} must be > 0 (1 = off)")
        if kw.get("min_new_tokens", 0) > kw.get("max_new_tokens", cls.max_new_tokens):
            raise BadRequest(f"{label('min_new_tokens')}={kw['min_new_tokens']} must not exceed "
                             f"{label('max_new_tokens')}={kw.get('max_new_tokens', cls.max_new_tokens)}")
        seed = obj.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise BadRequest(f"{label('seed')} must be an integer")
            kw["seed"] = seed & ((1 << 63) - 1)
        stop = obj.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise BadRequest(f"{label('stop')} must be a string or a list of strings")
            if any(s == "" for s in stop):
                raise BadRequest(f"{label('stop')} must not contain empty strings")
            kw["stop"] = tuple(stop)
        sti = obj.get("stop_token_ids")
        if sti is not None:
            if not isinstance(sti, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sti
            ):
                raise BadRequest(f"{label('stop_token_ids')} must be a list of non-negative integers")
            kw["stop_token_ids"] = tuple(sti)
        ie = obj.get("ignore_eos")
        if ie is not None:
            if not isinstance(ie, bool):
                raise BadRequest(f"{label('ignore_eos')} must be a boolean")
            kw["ignore_eos"] = ie
        if obj.get("logit_bias") is not None:
            kw["logit_bias"] = parse_logit_bias(obj["logit_bias"], label("logit_bias"))
        if kw.get("min_new_tokens") and kw.get("stop"):
            # vLLM does not match stop strings before min_tokens; our stop strings are matched
            # in the front (server/request_state.py), which does not know min_new_tokens yet
            raise unsupported(f"{label('min_new_tokens')} together with {label('stop')}")
        kw["grammar"] = from_sglang_sampling(obj, label)
        return cls(**kw)


def parse_logit_bias(v: object, field: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object {"token id": bias}; ids are decimal strings (int keys of a
    dict built in-process are taken too), biases numbers in [-100, 100]. -> ((id, bias), ...)
    sorted by id. Whether an id is inside the model's vocabulary is checked by the engine
    (Engine.validate), which knows the model's vocabulary size."""
    if not isinstance(v, dict):
        raise BadRequest(f"{field} must be an object mapping token ids to biases, got {type(v).__name__}")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(f"{field} has {len(v)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out: dict[int, float] = {}
    lo, hi = LOGIT_BIAS_RANGE
    for key, bias in v.items():
        tid = None
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tid = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:  # built in-process
            tid = key
        if tid is None:
            raise BadRequest(f"{field} key {key!r} is not a token id (a non-negative integer string)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise BadRequest(f"{field}[{key!r}] must be a number, got {type(bias).__name__}")
        bias = float(bias)
        if not math.isfinite(bias) or not lo <= bias <= hi:
            raise BadRequest(f"{field}[{key!r}]={bias} is out of range [{lo}, {hi}]")
        if tid in out:
            raise BadRequest(f"{field} names token id {tid} twice")
        out[tid] = bias
    return tuple(sorted(out.items()))
