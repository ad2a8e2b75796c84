"""A stub LLM server for bench tests: `/generate`, `/v1/completions` and `/v1/chat/completions`,
all streamed, with a configurable TTFT, per-token delay and error rate, and a toy prefix cache
whose hits it can report as cached prompt tokens.

Run: `python tests/stub_openai_server.py [--ttft S] [--token-delay S] ...`; it binds a free port on
127.0.0.1 and prints `READY <port>`. POST /_stub/config {field: value} changes the config and
resets the stats; GET /_stub/stats reports arrivals, peak concurrency, the request bodies, the
answers streamed, when each reply ended and the cached tokens reported (all by body index).
Prompt "tokens" are the whitespace words of the prompt text (chat: the messages' contents).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import time
from dataclasses import asdict, dataclass, field, fields, replace

from aiohttp import web


@dataclass(frozen=True)
class StubConfig:
    ttft: float = 0.0  # seconds before the first token
    token_delay: float = 0.0  # seconds per further token
    error_rate: float = 0.0  # fraction of requests that fail, spread evenly in arrival order
    error_mode: str = "http"  # "http": 500 before streaming; "stream": an error event mid-stream
    tokens_per_chunk: int = 1
    report_usage: bool = True  # False: no usage / meta_info counts (client must count itself)
    eos_after: int = 0  # > 0: stop after this many tokens unless ignore_eos is set
    model: str = "stub-model"
    report_cached: bool = False  # report cached_tokens: the longest word prefix of an earlier prompt
    tag_answers: bool = False  # answer tokens "r<body index>.<i>" (unique) instead of "tok<i>"
    fail_marker: str = ""  # fail (as error_mode says) every request whose body JSON contains it


@dataclass
class StubStats:
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each request
    bodies: list[dict] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # full text streamed ("" until it starts)
    ends: list[float] = field(default_factory=list)  # time.monotonic() a reply finished (0: never)
    cached: list[int] = field(default_factory=list)  # cached_tokens the toy cache found
    flushes: int = 0  # POST /reset_prefix_cache calls
    inflight: int = 0
    max_inflight: int = 0
    errors_injected: int = 0


class _InflightTicket:
    """Counts one request in flight until released (idempotent)."""

    def __init__(self, stats: StubStats):
        self.stats, self.held = stats, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.stats.inflight -= 1


class Stub:
    def __init__(self, cfg: StubConfig):
        self.cfg = cfg
        self.stats = StubStats()
        self.seen: list[list[str]] = []  # prompt words of every request (the toy prefix cache)

    def _cache_lookup(self, words: list[str]) -> int:
        """Words of the longest prefix `words` shares with an earlier prompt, then remember it."""
        best = 0
        for old in self.seen:
            n = 0
            for a, b in zip(old, words):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.seen.append(words)
        return best

    def _should_fail(self, index: int) -> bool:
        r = self.cfg.error_rate
        return math.floor((index + 1) * r + 1e-9) > math.floor(index * r + 1e-9)

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "invalid_request_error"}},
                                 status=status)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        stats = self.stats
        index = len(stats.arrivals)
        stats.arrivals.append(time.monotonic())
        stats.inflight += 1
        stats.max_inflight = max(stats.max_inflight, stats.inflight)
        # Released before the reply's last byte (plain responses are written after the handler
        # returns), so a client that waits for a reply's end is never seen over its cap.
        ticket = _InflightTicket(stats)
        try:
            try:
                body = await request.json()
            except ValueError:
                return self._error(400, "body is not JSON")
            stats.bodies.append(body)
            stats.paths.append(request.path)
            stats.answers.append("")
            stats.ends.append(0.0)
            words = _prompt_words(body)
            stats.cached.append(self._cache_lookup(words))
            marked = bool(self.cfg.fail_marker) and self.cfg.fail_marker in json.dumps(body)
            return await self._serve(request, body, self._should_fail(index) or marked, ticket,
                                     len(stats.bodies) - 1, words)
        finally:
            ticket.release()

    async def _serve(self, request: web.Request, body: dict, fail: bool, ticket: "_InflightTicket",
                     bi: int, words: list[str]) -> web.StreamResponse:
        native = request.path == "/generate"
        params = body.get("sampling_params", {}) if native else body
        n = params.get("max_new_tokens" if native else "max_tokens")
        problem = ("max tokens must be an int >= 1" if not isinstance(n, int) or n < 1 else
                   "the stub only streams" if body.get("stream") is not True else
                   "model is required" if not native and not body.get("model") else "")
        if problem:
            return self._error(400, problem)
        if self.cfg.eos_after and not params.get("ignore_eos"):
            n = min(n, self.cfg.eos_after)
        if fail and self.cfg.error_mode == "http":
            self.stats.errors_injected += 1
            return web.json_response({"error": {"message": "stub injected failure",
                                                "type": "internal_error"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        emit = _EMITTERS[request.path]
        usage = body.get("stream_options", {}).get("include_usage") or native
        prompt_tokens = len(words)
        cached = self.stats.cached[bi] if self.cfg.report_cached else None
        tag = f"r{bi}." if self.cfg.tag_answers else "tok"

        def tok(a: int, b: int) -> str:
            return "".join(f"{tag}{i} " for i in range(a, b))

        self.stats.answers[bi] = tok(0, n)
        await asyncio.sleep(self.cfg.ttft)
        done, k = 0, max(1, self.cfg.tokens_per_chunk)
        while done < n:
            step = min(k, n - done)
            if done:
                await asyncio.sleep(self.cfg.token_delay * step)
            done += step
            counts = (prompt_tokens, done, cached) if self.cfg.report_usage else None
            await _send(resp, emit(tok, done - step, done, n, counts))
            if fail and self.cfg.error_mode == "stream":
                self.stats.errors_injected += 1
                await _send(resp, {"error": {"message": "stub injected stream error",
                                             "type": "internal_error"}})
                break
        if usage and self.cfg.report_usage and not native and not fail:
            u = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            if cached is not None:
                u["prompt_tokens_details"] = {"cached_tokens": cached}
            await _send(resp, {"id": "stub", "choices": [], "usage": u})
        self.stats.ends[bi] = time.monotonic()
        ticket.release()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.cfg.model, "object": "model"}]})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def set_config(self, request: web.Request) -> web.Response:
        changes = await request.json()
        known = {f.name for f in fields(StubConfig)}
        if not isinstance(changes, dict) or set(changes) - known:
            return self._error(400, f"config keys must be among {sorted(known)}")
        self.cfg = replace(self.cfg, **changes)
        self.stats = StubStats()
        self.seen = []
        return web.json_response(asdict(self.cfg))

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        """vLLM's route (the stub has no /flush_cache, so a client must fall back to this)."""
        self.seen = []
        self.stats.flushes += 1
        return web.Response(text="")

    async def get_stats(self, _: web.Request) -> web.Response:
        return web.json_response(asdict(self.stats))


def _prompt_words(body: dict) -> list[str]:
    if isinstance(body.get("messages"), list):
        return " ".join(str(m.get("content", "")) for m in body["messages"]
                        if isinstance(m, dict)).split()
    prompt = body.get("text", body.get("prompt"))
    return (prompt if isinstance(prompt, str) else json.dumps(prompt)).split()


def _finish(done: int, n: int) -> str | None:
    return "length" if done == n else None


def _native(tok, a: int, b: int, n: int, counts) -> dict:
    meta = {"id": "stub", "finish_reason": {"type": "length", "length": n} if b == n else None}
    if counts:
        meta.update(prompt_tokens=counts[0], completion_tokens=counts[1])
        if counts[2] is not None:
            meta["cached_tokens"] = counts[2]
    return {"text": tok(0, b), "meta_info": meta}


def _completions(tok, a: int, b: int, n: int, counts) -> dict:
    return {"id": "stub", "object": "text_completion",
            "choices": [{"index": 0, "text": tok(a, b), "finish_reason": _finish(b, n)}]}


def _chat(tok, a: int, b: int, n: int, counts) -> dict:
    delta = {"content": tok(a, b)}
    if a == 0:
        delta["role"] = "assistant"
    return {"id": "stub", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": _finish(b, n)}]}


_EMITTERS = {"/generate": _native, "/v1/completions": _completions, "/v1/chat/completions": _chat}


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def build_app(stub: Stub) -> web.Application:
    app = web.Application()
    for path in _EMITTERS:
        app.router.add_post(path, stub.handle)
    app.router.add_get("/v1/models", stub.models)
    app.router.add_get("/health", stub.health)
    app.router.add_post("/reset_prefix_cache", stub.reset_prefix_cache)
    app.router.add_post("/_stub/config", stub.set_config)
    app.router.add_get("/_stub/stats", stub.get_stats)
    return app


async def _serve_forever(cfg: StubConfig) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(build_app(Stub(cfg)))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"READY {sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(StubConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true"), default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    args = parser.parse_args()
    asyncio.run(_serve_forever(StubConfig(**vars(args))))


if __name__ == "__main__":
    main()
