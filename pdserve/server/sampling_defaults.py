"""Sampling defaults from the model's generation_config.json (`--generation-config`, vLLM's flag).

`auto` reads <model dir>/generation_config.json, a directory reads its generation_config.json,
`vllm` uses none. Of the file, the keys vLLM takes are used (temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens), each only for a request that leaves that field unset; on
every route, so a PD pair (same model directory) samples the first token exactly as its decode
continues. A bad value in the file is a start-up error naming the file and the key.
"""

from __future__ import annotations

import json
import os

from ..core.errors import BadRequest
from ..core.sampling import SamplingParams

GENERATION_CONFIG = "generation_config.json"
DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def load_sampling_defaults(mode: str, model_dir: str) -> dict:
    """The defaults for `--generation-config mode` (SamplingParams names -> values)."""
    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else mode
    path = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.isfile(path):
        if mode == "auto":
            return {}
        raise ValueError(f"--generation-config {mode}: no {GENERATION_CONFIG} in that directory")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    out = {k: cfg[k] for k in DEFAULT_KEYS if cfg.get(k) is not None}
    if out.get("top_k") == 0:  # HF's "off"
        out["top_k"] = -1
    try:
        SamplingParams.from_json(out, prefix=f"{path}: ")
    except BadRequest as e:
        raise ValueError(e.message) from None
    return out


def with_defaults(raw: dict | None, defaults: dict) -> dict | None:
    """`raw` (a request's sampling fields, SamplingParams names) with the unset ones defaulted."""
    if not defaults or (raw is not None and not isinstance(raw, dict)):
        return raw  # a non-object is refused by SamplingParams.from_json
    out = dict(raw or {})
    for k, v in defaults.items():
        if out.get(k) is None:
            out[k] = v
    return out
