"""A small aiohttp stand-in for a pdserve prefill or decode server, for router tests and benchmarks.

Run it as a subprocess: `python tests/stub_pd_server.py --role decode --port 0`; it prints
`STUB READY port=N` once listening. It answers /generate and the OpenAI routes with text derived
from the body and echoes the PD fields it got under `pd`; knobs (CLI flags, or POST /_control at
run time): delay, hold until POST /_release, fail with a status (and error object), drop the connection before
answering (drop_times), close the connection mid-stream, hold the stream after its
first chunk until POST /_release, report unhealthy, reported load. GET /_received returns the
bodies it got, the requests cancelled by the client (connection closed) and those it completed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank")
KNOBS = ("delay", "hold", "fail_status", "fail_times", "close_mid_stream", "stream_gate", "healthy", "load",
         "stream_chunks", "drop_times", "fail_error", "fail_retry_after")


class Stub:
    def __init__(self, args: argparse.Namespace):
        self.role = args.role
        self.dp_size = args.dp_size
        self.delay = args.delay
        self.hold = args.hold
        self.fail_status = args.fail_status
        self.fail_times = 0  # with fail_status: fail only this many generations (0: every one)
        self.fail_error = None  # with fail_status: the reply's "error" object (None: a stub_error)
        self.fail_retry_after = None  # with fail_status: its Retry-After header
        self.failed = 0
        self.drop_times = 0  # close this many generations' connections before answering
        self.close_mid_stream = args.close_mid_stream
        self.stream_gate = args.stream_gate
        self.stream_chunks = args.stream_chunks
        self.healthy = True
        self.load = args.load
        self.record = not args.no_record
        self.gate = asyncio.Event()
        self.received: list[dict] = []
        self.cancelled: list[dict] = []
        self.completed: list[dict] = []

    # ---- replies -------------------------------------------------------------------------
    def pd_echo(self, body: dict) -> dict:
        return {k: body.get(k) for k in PD_FIELDS if k in body}

    def text_of(self, prompt) -> str:
        return f"{self.role} saw {json.dumps(prompt, sort_keys=True)}"

    def generate_item(self, body: dict, prompt, index: int) -> dict:
        logprob = -0.5 if self.role == "prefill" else -9.0
        meta = {"id": body.get("rid") or f"stub-{index}", "finish_reason": {"type": "length", "length": 2},
                "prompt_tokens": 3, "completion_tokens": 2, "pd": self.pd_echo(body), "server_role": self.role}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = [[logprob, index, None]]
        return {"text": self.text_of(prompt), "output_ids": [7, 8], "meta_info": meta}

    def reply(self, path: str, body: dict):
        if path == "/generate":
            prompt = body.get("text", body.get("input_ids"))
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                return [self.generate_item(body, p, i) for i, p in enumerate(prompt)]
            return self.generate_item(body, prompt, 0)
        content = self.text_of(body.get("messages", body.get("prompt")))
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}
                  if path.endswith("chat/completions") else {"index": 0, "text": content, "finish_reason": "length"})
        return {"id": "stub", "object": "stub", "choices": [choice], "pd": self.pd_echo(body),
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

    # ---- handlers ------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        entry = {"path": request.path, "body": body, "authorization": request.headers.get("Authorization")}
        if self.record:
            self.received.append(entry)
        room = body.get("bootstrap_room")
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.hold:
                await asyncio.wait_for(self.gate.wait(), 60)
            if self.drop_times > 0:
                self.drop_times -= 1
                request.transport.close()
                return web.Response(status=500)  # never sent: the connection is gone
            if self.fail_status and (not self.fail_times or self.failed < self.fail_times):
                self.failed += 1
                return web.json_response({"error": self.fail_error or {
                    "message": f"stub {self.role} failure for room {room}", "type": "stub_error"}},
                    status=self.fail_status,
                    headers={"Retry-After": str(self.fail_retry_after)} if self.fail_retry_after else None)
            if body.get("stream"):
                return await self.stream(request, body)
            resp = web.Response(body=json.dumps(self.reply(request.path, body)), content_type="application/json")
        except asyncio.CancelledError:
            self.cancelled.append({"path": request.path, "room": room})
            raise
        if self.record:
            self.completed.append({"path": request.path, "room": room})
        return resp

    async def stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        item = self.reply(request.path, body)
        for i in range(self.stream_chunks):
            await resp.write(b"data: " + json.dumps({"chunk": i, "item": item}).encode() + b"\n\n")
            if i == 0 and self.close_mid_stream:
                request.transport.close()
                return resp
            if i == 0 and self.stream_gate:
                await asyncio.wait_for(self.gate.wait(), 60)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        if self.record:
            self.completed.append({"path": request.path, "room": body.get("bootstrap_room")})
        return resp

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"error": {"message": "stub unhealthy", "type": "unavailable"}}, status=503)
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        workers = [{"dp_rank": r, "total_pages": 100, "free_pages": 100, "cached_pages": 0,
                    "running_requests": self.load if r == 0 else 0, "waiting_requests": 0,
                    "inflight_transfers": 0} for r in range(self.dp_size)]
        return web.json_response({"model_path": "/tmp/stub-model", "disaggregation_mode": self.role,
                                  "dp_size": self.dp_size, "tp_size": 1, "load_balance_method": "round_robin",
                                  "page_size": 16, "bootstrap_port": 8998, "workers": workers})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model",
                                                              "owned_by": self.role}]})

    async def received_view(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.received, "cancelled": self.cancelled,
                                  "completed": self.completed})

    async def control(self, request: web.Request) -> web.Response:
        for key, value in (await request.json()).items():
            if key not in KNOBS:
                return web.json_response({"error": {"message": f"unknown knob {key}"}}, status=400)
            setattr(self, key, value)
        return web.json_response({k: getattr(self, k) for k in KNOBS})

    async def reset(self, request: web.Request) -> web.Response:
        self.received.clear()
        self.cancelled.clear()
        self.completed.clear()
        self.gate.clear()
        self.failed = 0
        return web.json_response({"status": "ok"})

    async def release(self, request: web.Request) -> web.Response:
        self.gate.set()
        return web.json_response({"status": "ok"})

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/_received", self.received_view)
        app.router.add_post("/_control", self.control)
        app.router.add_post("/_reset", self.reset)
        app.router.add_post("/_release", self.release)
        return app


async def main(args: argparse.Namespace) -> None:
    stub = Stub(args)
    runner = web.AppRunner(stub.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=4096).start()
    print(f"STUB READY port={runner.addresses[0][1]}", flush=True)
    deadline = time.monotonic() + args.max_lifetime
    while time.monotonic() < deadline:  # a stub left behind by a crashed test still goes away
        await asyncio.sleep(1.0)
    await runner.cleanup()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--delay", type=float, default=0.0, help="seconds before answering a generation")
    p.add_argument("--hold", action="store_true", help="hold generations until POST /_release")
    p.add_argument("--fail-status", type=int, default=0, help="answer generations with this status")
    p.add_argument("--close-mid-stream", action="store_true", help="close the connection after chunk 0")
    p.add_argument("--stream-gate", action="store_true", help="hold streams after chunk 0 until /_release")
    p.add_argument("--stream-chunks", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="running_requests reported by /server_info")
    p.add_argument("--no-record", action="store_true", help="keep no bodies (benchmarks)")
    p.add_argument("--max-lifetime", type=float, default=600.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(args))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop_runner:
            loop_runner.run(main(args))
