"""Sampling parameters: one typed dataclass, validated once at the HTTP edge."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import BadRequest

MAX_NEW_TOKENS_LIMIT = 1 << 20


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def replace(self, **kw) -> "SamplingParams":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        return SamplingParams(**d)

    @classmethod
    def from_json(cls, obj: object) -> "SamplingParams":
        """Parse and validate a JSON `sampling_params` object; unknown keys are ignored."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise BadRequest("sampling_params must be an object")
        kw: dict = {}

        def num(name, lo=None, hi=None, integer=False, nullable=True):
            if name not in obj or (obj[name] is None and nullable):
                return
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BadRequest(f"sampling_params.{name} must be a number, got {type(v).__name__}")
            if integer:
                if isinstance(v, float) and not v.is_integer():
                    raise BadRequest(f"sampling_params.{name} must be an integer, got {v}")
                v = int(v)
            else:
                v = float(v)
            if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
                raise BadRequest(f"sampling_params.{name}={v} is out of range [{lo}, {hi}]")
            kw[name] = v

        num("max_new_tokens", 0, MAX_NEW_TOKENS_LIMIT, integer=True)
        num("temperature", 0.0, 100.0)
        num("top_p", 0.0, 1.0)
        num("top_k", -1, 1 << 30, integer=True)
        num("min_p", 0.0, 1.0)
        num("n", 1, 64, integer=True)
        if "top_p" in kw and kw["top_p"] <= 0.0:
            raise BadRequest("sampling_params.top_p must be > 0")
        if kw.get("top_k") == 0:
            raise BadRequest("sampling_params.top_k must be -1 (disabled) or >= 1")
        seed = obj.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise BadRequest("sampling_params.seed must be an integer")
            kw["seed"] = seed & ((1 << 63) - 1)
        stop = obj.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise BadRequest("sampling_params.stop must be a string or a list of strings")
            if any(s == "" for s in stop):
                raise BadRequest("sampling_params.stop must not contain empty strings")
            kw["stop"] = tuple(stop)
        sti = obj.get("stop_token_ids")
        if sti is not None:
            if not isinstance(sti, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sti
            ):
                raise BadRequest("sampling_params.stop_token_ids must be a list of non-negative integers")
            kw["stop_token_ids"] = tuple(sti)
        ie = obj.get("ignore_eos")
        if ie is not None:
            if not isinstance(ie, bool):
                raise BadRequest("sampling_params.ignore_eos must be a boolean")
            kw["ignore_eos"] = ie
        return cls(**kw)
