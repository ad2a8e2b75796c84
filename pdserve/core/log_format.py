"""Structured log lines: one line per event, `key=value` (text) or JSON, each carrying the
process's role, server instance id and DP rank, plus the event's own fields (room, rid, ...).

Call sites pass event fields as `extra`: `log.info("handoff ok", extra=fields(room=r, rid=x))`.
`configure_logging` is called once per process (front, worker, router) at start-up.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any

LOG_FORMATS = ("text", "json")
QUIET_LIBRARIES = ("httpx", "httpcore")  # a line per HTTP call of the bootstrap client: warnings only
_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "color_message"}  # color_message: uvicorn's colored copy of msg
_CONTEXT_KEYS = ("role", "instance", "dp_rank")


def new_instance_id() -> str:
    """A short random id naming one start of one server (workers share their front's)."""
    return uuid.uuid4().hex[:12]


def fields(**kw: Any) -> dict[str, Any]:
    """Event fields for a log call's `extra`; None values are left out."""
    return {k: v for k, v in kw.items() if v is not None}


@dataclass(frozen=True)
class LogContext:
    """What every line of this process carries."""

    role: str
    instance: str = ""
    dp_rank: int | None = None


class ContextFilter(logging.Filter):
    """Stamps the process context on every record (a record's own value wins)."""

    def __init__(self, ctx: LogContext):
        super().__init__()
        self.ctx = ctx

    def filter(self, record: logging.LogRecord) -> bool:
        for key in _CONTEXT_KEYS:
            if not hasattr(record, key):
                setattr(record, key, getattr(self.ctx, key))
        return True


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The line's fields in a fixed order: time, level, context, logger, msg, event fields."""
    out: dict[str, Any] = {"ts": _iso(record.created), "level": record.levelname.lower()}
    for key in _CONTEXT_KEYS:
        v = getattr(record, key, None)
        if v is not None and v != "":
            out[key] = v
    out["logger"] = record.name
    out["msg"] = record.getMessage()
    for key, v in record.__dict__.items():
        if key not in _RESERVED and key not in _CONTEXT_KEYS and not key.startswith("_"):
            out[key] = v
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def _text_value(v: Any) -> str:
    if isinstance(v, float):
        v = f"{v:.6g}"
    elif not isinstance(v, (str, int)):
        v = json.dumps(v, default=str, separators=(",", ":"))
    s = str(v)
    if s == "" or any(c in s for c in ' "=\n\t\\'):
        return json.dumps(s)
    return s


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=info role=decode instance=... dp_rank=0 logger=... msg="..." room=...`"""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_text_value(v)}" for k, v in event_fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the same keys as the text format."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(event_fields(record), default=str, ensure_ascii=False)


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {LOG_FORMATS}")
    return JsonFormatter() if fmt == "json" else KeyValueFormatter()


def configure_logging(level: str, fmt: str, ctx: LogContext, stream: IO[str] | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one structured handler (stderr by default).
    Uvicorn's own loggers propagate here when it is started with `log_config=None`."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    handler.addFilter(ContextFilter(ctx))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(root.level, logging.WARNING))
    return handler
