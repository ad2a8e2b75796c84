"""How the bench talks to each server API, and the streaming request driver that times it.

A `Backend` builds one streaming request body and reads the SSE events of its reply;
`send_request` posts it, times every content chunk and fills a `RequestRecord`.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import aiohttp

from .datasets import BenchRequest, TokenCounter
from .metrics import RequestRecord


@dataclass(frozen=True)
class BackendOptions:
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)


@dataclass
class StreamState:
    """What one reply has produced so far (read by backends, written by the driver)."""

    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class StreamEvent:
    """One parsed SSE event: `content` is True when it carries generated output."""

    text: str = ""
    content: bool = False
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    error: str | None = None


def _count(value) -> int | None:
    """A token count from a reply, or None when it is missing or not an int (unknown, not 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _error_text(err) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


class Backend(ABC):
    """One server API. Contract: `payload` asks for a streamed reply of exactly
    `req.output_len` tokens (max tokens set, EOS ignored unless disabled); `parse` maps one
    SSE `data:` JSON object to a StreamEvent without side effects, reading `state` only."""

    name: str
    path: str

    @abstractmethod
    def payload(self, req: BenchRequest, opts: BackendOptions) -> dict: ...

    @abstractmethod
    def parse(self, data: dict, state: StreamState) -> StreamEvent: ...


class PDServeBackend(Backend):
    """Native `/generate`: each event holds the cumulative text and meta_info counts
    (`cached_tokens`: prompt tokens found in the prefix cache)."""

    name, path = "pdserve", "/generate"

    def payload(self, req: BenchRequest, opts: BackendOptions) -> dict:
        body = {"text": req.prompt, "stream": True,
                "sampling_params": {"max_new_tokens": req.output_len,
                                    "temperature": opts.temperature,
                                    "ignore_eos": opts.ignore_eos}}
        return {**body, **opts.extra_body}

    def parse(self, data: dict, state: StreamState) -> StreamEvent:
        if "error" in data:
            return StreamEvent(error=_error_text(data["error"]))
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return StreamEvent(error=f"aborted: {finish.get('message', '')}")
        text = data.get("text") or ""
        # Cumulative per the contract; tolerate servers that stream increments.
        delta = text[len(state.text):] if text.startswith(state.text) else text
        done = meta.get("completion_tokens")
        grew = isinstance(done, int) and done > (state.completion_tokens or 0)
        return StreamEvent(text=delta, content=bool(delta) or grew, completion_tokens=done,
                           prompt_tokens=meta.get("prompt_tokens"),
                           cached_tokens=_count(meta.get("cached_tokens")))


class _OpenAIBackend(Backend):
    """OpenAI routes; `include_usage` makes the last event carry usage, whose
    `prompt_tokens_details.cached_tokens` is the prefix-cache hit when the server reports it."""

    def _common(self, req: BenchRequest, opts: BackendOptions) -> dict:
        return {"model": opts.model, "max_tokens": req.output_len, "temperature": opts.temperature,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": opts.ignore_eos}

    @abstractmethod
    def _choice_text(self, choice: dict) -> str: ...

    def parse(self, data: dict, state: StreamState) -> StreamEvent:
        if "error" in data:
            return StreamEvent(error=_error_text(data["error"]))
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        text = ""
        for choice in data.get("choices") or []:
            if choice.get("finish_reason") in ("abort", "error"):
                return StreamEvent(error=f"finish_reason={choice['finish_reason']}")
            text += self._choice_text(choice) or ""
        return StreamEvent(text=text, content=bool(text),
                           completion_tokens=usage.get("completion_tokens"),
                           prompt_tokens=usage.get("prompt_tokens"),
                           cached_tokens=_count(details.get("cached_tokens")))


class OpenAICompletionsBackend(_OpenAIBackend):
    name, path = "openai-completions", "/v1/completions"

    def payload(self, req: BenchRequest, opts: BackendOptions) -> dict:
        return {**self._common(req, opts), "prompt": req.prompt, **opts.extra_body}

    def _choice_text(self, choice: dict) -> str:
        return choice.get("text") or ""


class OpenAIChatBackend(_OpenAIBackend):
    name, path = "openai-chat", "/v1/chat/completions"

    def payload(self, req: BenchRequest, opts: BackendOptions) -> dict:
        msgs = ([{"role": m.role, "content": m.content} for m in req.messages]
                or [{"role": "user", "content": req.prompt}])
        return {**self._common(req, opts), "messages": msgs, **opts.extra_body}

    def _choice_text(self, choice: dict) -> str:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (PDServeBackend, OpenAICompletionsBackend, OpenAIChatBackend)}


def endpoint_url(base_url: str, backend: Backend) -> str:
    """`base_url` plus the backend's path, unless the URL already ends with it."""
    base = base_url.rstrip("/")
    return base if base.endswith(backend.path) else base + backend.path


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    body = await resp.text()
    try:
        msg = _error_text(json.loads(body).get("error", body))
    except (ValueError, AttributeError):
        msg = body.strip()
    return f"HTTP {resp.status}: {msg[:300]}"


async def _sse_data(resp: aiohttp.ClientResponse):
    """Yield each SSE `data:` payload as a string, as soon as its line is complete."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", errors="replace")
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip().decode("utf-8", errors="replace")


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None,
                  backend: Backend, state: StreamState, chunk_times: list[float]) -> str:
    """Read one streamed reply into `state` and `chunk_times`; return an error or ""."""
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            return await _http_error(resp)
        async for data in _sse_data(resp):
            if data == "[DONE]":
                return "" if chunk_times else "stream finished with no output"
            ev = backend.parse(json.loads(data), state)
            if ev.error is not None:
                return f"stream error: {ev.error}"
            if ev.content:
                chunk_times.append(time.perf_counter())
            state.text += ev.text
            if ev.completion_tokens is not None:
                state.completion_tokens = ev.completion_tokens
            if ev.prompt_tokens is not None:
                state.prompt_tokens = ev.prompt_tokens
            if ev.cached_tokens is not None:
                state.cached_tokens = ev.cached_tokens
    return "stream ended before data: [DONE]"


async def send_request(session: aiohttp.ClientSession, url: str, backend: Backend,
                       req: BenchRequest, opts: BackendOptions, record: RequestRecord,
                       timeout_s: float, headers: dict | None = None,
                       counter: TokenCounter | None = None) -> RequestRecord:
    """Post one streaming request and fill `record`; every failure lands in record.error."""
    return (await send_and_read(session, url, backend, req, opts, record, timeout_s, headers,
                                counter))[0]


async def send_and_read(session: aiohttp.ClientSession, url: str, backend: Backend,
                        req: BenchRequest, opts: BackendOptions, record: RequestRecord,
                        timeout_s: float, headers: dict | None = None,
                        counter: TokenCounter | None = None) -> tuple[RequestRecord, str]:
    """`send_request` that also returns the streamed text (a multi-turn chat resends it)."""
    state = StreamState()
    chunk_times: list[float] = []
    body = backend.payload(req, opts)
    start = time.perf_counter()
    try:
        record.error = await asyncio.wait_for(
            _stream(session, url, body, headers, backend, state, chunk_times), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timeout: no complete reply within {timeout_s:g}s"
    except json.JSONDecodeError as e:
        record.error = f"bad SSE data (not JSON): {e}"
    except aiohttp.ClientError as e:
        record.error = f"{type(e).__name__}: {e}".rstrip(": ")
    if record.error:
        return record, state.text
    end = time.perf_counter()
    record.success = True
    record.ttft = chunk_times[0] - start
    record.e2e = end - start
    record.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    record.chunks = len(chunk_times)
    record.server_prompt_tokens = state.prompt_tokens
    record.cached_tokens = state.cached_tokens
    if state.completion_tokens is not None:
        record.output_len = state.completion_tokens
    elif counter is not None and counter.exact:
        record.output_len = counter.count(state.text)
    else:
        record.output_len = len(chunk_times)
    return record, state.text
