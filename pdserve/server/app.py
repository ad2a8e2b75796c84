"""The FastAPI app of a server front: the HTTP routes of docs/architecture.md over one `Front`.

The app's lifespan starts the front (workers, role) and stops it on shutdown. Every error
leaves as JSON {"error": {"message", "type", "code"}}; nothing escapes as a crash.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ..core.errors import BadRequest, NotFound, PDServeError, Unavailable
from .api_options import ApiOptions
from .front import Front, error_from
from .http_metrics import HTTPMetricsMiddleware
from .http_utils import (
    SSE_DONE,
    ApiKeyMiddleware,
    ClientGone,
    SSEResponse,
    error_response,
    json_body,
    sse,
    until_disconnect,
)
from .limits import BodyLimit
from .openai_api import OpenAIReply
from .openai_protocol import parse_chat, parse_completion
from .protocol import NativeCall, item_reply, opt_bool, parse_generate
from .request_state import ActiveRequest, ItemProgress
from .resume import ProgressLines, wants_progress
from .running import RunningRequests
from .tokenize_api import detokenize, tokenize

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's code for "client closed request"; never seen by the client


async def collect(active: ActiveRequest) -> list[ItemProgress]:
    """Run every item to the end; a worker error fails the whole request."""
    async for prog in active.events():
        if prog.error:
            raise error_from(prog.error)
    return sorted(active.progress.values(), key=lambda p: p.item.index)


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Turn a failure mid-stream into an error event; always end with [DONE]."""
    try:
        async for chunk in events:
            yield chunk
    except PDServeError as e:
        yield sse(e.to_json())
    except Exception as e:  # noqa: BLE001 - the stream must end cleanly
        log.exception("stream failed")
        yield sse(PDServeError(f"internal error: {type(e).__name__}: {e}").to_json())
    yield SSE_DONE


async def native_events(front: Front, call: NativeCall, active: ActiveRequest,
                        progress: ProgressLines | None = None) -> AsyncIterator[bytes]:
    async for prog in active.events():
        if prog.error:
            raise error_from(prog.error)
        data = sse(item_reply(prog, front.tokenizer, call.text_in_logprobs,
                              prog.item.index if call.batched else None, call.return_timeline))
        if progress is not None:  # a router that may migrate the stream (server/resume.py)
            data = progress.line(prog.rid, prog.output_ids, len(prog.output_ids), prog.finished,
                                 prog.resumed) + data
        yield data


async def openai_events(reply: OpenAIReply, active: ActiveRequest,
                        progress: ProgressLines | None = None) -> AsyncIterator[bytes]:
    async for prog in active.events():
        if prog.error:
            raise error_from(prog.error)
        chunk = reply.chunk(prog)
        if chunk is not None:
            data = sse(chunk)
            if progress is not None:
                data = progress.line(prog.rid, prog.output_ids, reply.streamed_tokens(prog.item.index),
                                     prog.finished, prog.resumed) + data
            yield data
    usage = reply.usage_chunk(list(active.progress.values()))
    if usage is not None:
        yield sse(usage)


async def _start(front: Front, items, running: RunningRequests | None = None
                 ) -> tuple[ActiveRequest, Callable[[], None]]:
    """Admit the request (a slot, or 429 when the server is full), then send its items to the
    workers; the returned close() aborts what is unfinished and frees the slot. While it runs,
    `running` lists it for /abort_request."""
    gen = front.generator
    if running is not None:
        for it in items:
            if it.resume is not None:
                await running.take_over(it.rid, gen.pool.is_free)
    slot = await front.admit(items)
    try:
        active = gen.start(items)
    except BaseException:
        slot.release()
        raise
    if running is not None:
        running.add(active)

    def close() -> None:
        if running is not None:
            running.remove(active)
        active.close()
        slot.release()
    return active, close


async def _finish(request: Request, active: ActiveRequest, close: Callable[[], None], stream_events,
                  build_reply) -> Response:
    """Stream (SSE) or collect-then-reply; the workers are aborted if the client leaves."""
    if stream_events is not None:
        return SSEResponse(_guarded(stream_events), close)
    try:
        progs = await until_disconnect(request, collect(active))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        close()
    return JSONResponse(build_reply(progs))


def _install_error_handlers(app: FastAPI, front: Front) -> None:
    async def on_pdserve_error(request: Request, exc: PDServeError):
        if exc.status >= 500:
            log.error("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(exc)

    async def on_http_error(request: Request, exc: StarletteHTTPException):
        err = NotFound(f"no route {request.method} {request.url.path}") if exc.status_code == 404 else \
            PDServeError(str(exc.detail))
        err.status = exc.status_code
        return error_response(err)

    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(BadRequest(str(exc)))

    async def on_any_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(PDServeError(f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(PDServeError, on_pdserve_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_any_error)


def build_app(front: Front, should_abort: Callable[[], bool] | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts and stops `front` (and so the worker processes)."""

    @asynccontextmanager
    async def lifespan(_app):
        try:
            await front.start(should_abort)
            yield
        finally:
            await front.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    _install_error_handlers(app, front)
    app.add_middleware(BodyLimit, max_bytes=front.cfg.max_request_bytes, error_response=error_response)
    if front.cfg.api_key:  # outside the body limit: a stranger gets 401 whatever the size
        app.add_middleware(ApiKeyMiddleware, api_key=front.cfg.api_key)
    tok = front.tokenizer
    cfg = front.cfg
    opts = ApiOptions.build(front.served_names, cfg.generation_config, front.model_dir,
                            tok.chat_template.source if tok.chat_template else None, cfg.tool_call_parser,
                            cfg.reasoning_parser)  # a bad flag or generation_config.json: ValueError now
    running = RunningRequests()

    @app.get("/health")
    async def health():
        if not front.healthy():
            why = "; ".join(f"dp rank {r}: {w}" for r, w in sorted(front.pool.dead.items())) or "not ready"
            return error_response(Unavailable(f"unhealthy: {why}"))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        await front.health_generate()
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return await front.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return front.model_info()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "pdserve",
            "root": front.model_dir, "max_model_len": front.generator.limits.max_context}
            for name in opts.served_names]}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return tokenize(await json_body(request), tok, opts, front.generator.limits.max_context)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return detokenize(await json_body(request), tok, opts)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await json_body(request)
        rid, abort_all = body.get("rid"), opt_bool(body, "abort_all")
        if not abort_all and (not isinstance(rid, str) or not rid):
            raise BadRequest("abort_request needs a rid (a non-empty string) or abort_all: true")
        aborted = running.abort(rid, abort_all)
        return {"success": True, "aborted": aborted}

    @app.api_route("/flush_cache", methods=["POST", "GET"])  # SGLang serves both
    async def flush_cache():
        return await front.flush_cache()

    @app.get("/metrics")
    async def metrics():
        return Response(await front.metrics_text(), media_type=front.metrics.content_type)

    @app.post("/generate")
    async def generate(request: Request):
        body = await json_body(request)
        call = parse_generate(body, tok, opts)
        progress = ProgressLines() if call.stream and wants_progress(body) else None
        active, close = await _start(front, call.items, running)
        events = native_events(front, call, active, progress) if call.stream else None

        def reply(progs):
            out = [item_reply(p, tok, call.text_in_logprobs, timeline=call.return_timeline) for p in progs]
            return out if call.batched else out[0]
        return await _finish(request, active, close, events, reply)

    async def openai_route(request: Request, chat: bool):
        body = await json_body(request)
        model = opts.check_model(body["model"] if isinstance(body.get("model"), str) else None)  # 404 first
        call = (parse_chat if chat else parse_completion)(body, tok, opts)
        resume = call.items[0].resume
        reply = OpenAIReply(call, tok, model, chat,
                            id=(resume and resume.reply_id) or "", created=(resume and resume.created) or 0)
        progress = ProgressLines({"id": reply.id, "created": reply.created}) \
            if call.stream and wants_progress(body) else None
        active, close = await _start(front, call.items, running)
        reply.resume(active.progress.values())
        events = openai_events(reply, active, progress) if call.stream else None
        return await _finish(request, active, close, events, reply.full)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_route(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai_route(request, chat=True)

    app.add_middleware(HTTPMetricsMiddleware, count=front.metrics.http_request,  # outermost: sees every status
                       paths=frozenset(r.path for r in app.routes))
    return app
