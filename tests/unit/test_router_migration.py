"""Request migration without processes: the router's stream relay, its continuation body and
pair choice (router/migration.py), and the servers' side of a continuation (server/resume.py)
driven end to end in-process: a stream cut at any event and continued from the router's
continuation body shows the client exactly the uninterrupted stream."""

from __future__ import annotations

import json

import pytest

from pdserve.core.config import Role
from pdserve.core.errors import BadRequest, Unavailable
from pdserve.core.messages import TokenOutput
from pdserve.core.migration_wire import PROGRESS_FIELD, RESUME_FIELD, progress_line
from pdserve.router.health import HealthTracker
from pdserve.router.legs import LegErrorKind
from pdserve.router.migration import Migration, StreamRelay, blocker, continuation, request_body
from pdserve.router.pd_body import Route, inspect_request, leg_bodies
from pdserve.router.policies import make_policy
from pdserve.router.upstream import Upstream, UpstreamPool
from pdserve.server.app import native_events, openai_events
from pdserve.server.openai_api import OpenAIReply
from pdserve.server.openai_protocol import parse_chat, parse_completion
from pdserve.server.protocol import parse_generate
from pdserve.server.request_state import ActiveRequest, ItemProgress
from pdserve.server.resume import ProgressLines, parse_resume
from pdserve.server.tokenizer import ServerTokenizer
from tests.harness.fake_worker import write_fake_model
from tests.unit.test_server_protocol import LetterTok, letters

DECODE = Upstream("http://d1", Role.DECODE, HealthTracker(1, 1))


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ServerTokenizer:
    d = tmp_path_factory.mktemp("model")
    write_fake_model(str(d))
    return ServerTokenizer.from_dir(str(d))


# ---- router: what may move -----------------------------------------------------------------
@pytest.mark.parametrize("route,body,why", [
    (Route.GENERATE, {"text": "x", "stream": True}, None),
    (Route.GENERATE, {"text": "x", "sampling_params": {"repetition_penalty": 1.3, "min_new_tokens": 2}}, None),
    (Route.CHAT, {"messages": [], "logprobs": False, "presence_penalty": 0}, None),
    (Route.GENERATE, {"text": ["a", "b"]}, "batched"),
    (Route.COMPLETIONS, {"prompt": "x", "n": 2}, "n > 1"),
    (Route.GENERATE, {"text": "x", "return_logprob": True}, "return_logprob"),
    (Route.COMPLETIONS, {"prompt": "x", "logprobs": 0}, "logprobs"),
    (Route.COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
    (Route.CHAT, {"messages": [], "frequency_penalty": 0.5}, "frequency_penalty"),
    (Route.GENERATE, {"text": "x", "sampling_params": {"presence_penalty": -1}}, "presence_penalty"),
    (Route.CHAT, {"messages": [], "response_format": {"type": "text"}, "tool_choice": "auto"}, None),
    (Route.CHAT, {"messages": [], "response_format": {"type": "json_object"}}, "structured output"),
    (Route.CHAT, {"messages": [], "tool_choice": "required"}, "structured output"),
    (Route.CHAT, {"messages": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "structured"),
    (Route.COMPLETIONS, {"prompt": "x", "guided_regex": "a+"}, "structured output"),
    (Route.GENERATE, {"text": "x", "sampling_params": {"json_schema": "{}"}}, "structured output"),
])
def test_blocker_names_what_cannot_move(route, body, why):
    got = blocker(inspect_request(route, body), body)
    assert (got is None) if why is None else (why in got)


def test_request_body_asks_for_progress_only_when_the_stream_may_move():
    assert request_body({"text": "x"}, Migration(), stream=True) == {"text": "x", PROGRESS_FIELD: True}
    assert request_body({"text": "x"}, Migration(), stream=False) == {"text": "x"}
    assert request_body({"text": "x"}, Migration(blocker="no"), stream=True) == {"text": "x"}
    assert request_body({"text": "x"}, Migration(enabled=False), stream=True) == {"text": "x"}


# ---- router: the relay -----------------------------------------------------------------------
def event(data: dict, ids=None, done=False, identity=None) -> bytes:
    line = progress_line(ids, done, identity) if ids is not None else b""
    return line + b"data: " + json.dumps(data).encode() + b"\n\n"


def test_relay_forwards_whole_events_strips_progress_and_counts_ids():
    m = Migration()
    relay = StreamRelay(m, DECODE)
    raw = (event({"text": "a"}, [1, 2], identity={"rid": "r", "id": "cmpl-1", "created": 7})
           + event({"text": "ab"}, [3]) + b"data: [DONE]\n\n")
    out = b"".join(relay.feed(raw[k:k + 5]) for k in range(0, len(raw), 5))  # split anywhere
    assert out == b'data: {"text": "a"}\n\ndata: {"text": "ab"}\n\ndata: [DONE]\n\n'
    assert m.ids == [1, 2, 3] and m.identity == {"rid": "r", "id": "cmpl-1", "created": 7}
    assert m.forwarded and not m.untracked and not m.done and relay.saw_done
    relay.end()
    assert relay.failure is None and m.refusal() is None


def test_relay_holds_back_an_error_event_as_the_failure():
    m = Migration()
    relay = StreamRelay(m, DECODE)
    err = {"error": {"message": "dp worker rank 0 is gone", "type": "unavailable", "code": 503}}
    out = relay.feed(event({"text": "a"}, [5]) + b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
    assert out == b'data: {"text": "a"}\n\n'  # what came before the error still goes out
    f = relay.failure
    assert f.kind is LegErrorKind.STATUS and f.status == 503 and f.upstream is DECODE
    assert "mid-stream: dp worker rank 0 is gone" in f.message and f.type == "unavailable"
    assert f.sent == err["error"]  # its code and other fields reach the client as sent
    assert m.ids == [5]


def test_relay_calls_a_body_cut_before_done_a_connection_failure():
    m = Migration()
    relay = StreamRelay(m, DECODE)
    relay.feed(event({"text": "a"}, [5]) + b'data: {"te')
    relay.end()
    assert relay.failure.kind is LegErrorKind.CONNECTION and "before [DONE]" in relay.failure.message


def test_untracked_text_or_an_ended_answer_cannot_move():
    m = Migration()
    StreamRelay(m, DECODE).feed(b'data: {"text": "a"}\n\n')  # a server that sends no progress
    assert "does not report stream progress" in m.refusal()
    m = Migration(blocker="logprobs streams are not migrated")
    StreamRelay(m, DECODE).feed(b'data: {"text": "a"}\n\n')
    assert m.refusal() == "logprobs streams are not migrated"
    m = Migration()
    StreamRelay(m, DECODE).feed(event({"text": "a"}, [1], done=True))
    assert m.refusal() == "the answer had already ended"
    assert Migration(blocker="x").refusal() is None  # nothing shown yet: the request can start again


# ---- router: the continuation body and the next pair ---------------------------------------
def test_continuation_body_carries_the_ids_the_identity_and_the_rid():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}
    m = Migration(ids=[4, 5], identity={"rid": "abc", "id": "chatcmpl-1", "created": 3}, forwarded=True)
    out = continuation(body, m, stream=True)
    assert out == {**body, PROGRESS_FIELD: True, "rid": "abc",
                   RESUME_FIELD: {"ids": [4, 5], "id": "chatcmpl-1", "created": 3}}
    assert body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}
    # nothing reached the client (or not streamed): the request again, as the client sent it
    assert continuation(body, Migration(), stream=True) == {**body, PROGRESS_FIELD: True}
    assert continuation({"text": "x"}, m, stream=False) == {"text": "x"}


def test_a_migrated_prefill_leg_gets_its_own_rid():
    p, d = leg_bodies({"text": "x", "rid": "r"}, "h", 1, 5, prefill_rid="r-migration-1")
    assert json.loads(p)["rid"] == "r-migration-1" and json.loads(d)["rid"] == "r"
    p, d = leg_bodies({"text": "x", "rid": "r"}, "h", 1, 5, (0, 1), "r-migration-1")
    assert json.loads(p)["rid"] == "r-migration-1" and json.loads(d)["rid"] == "r"
    p, d = leg_bodies({"text": "x"}, "h", 1, 5)
    assert p == d


def test_a_migration_never_picks_the_decode_that_failed():
    def up(url, role):
        return Upstream(url, role, HealthTracker(1, 1))
    pool = UpstreamPool([up("http://p", Role.PREFILL)], [up("http://d1", Role.DECODE), up("http://d2", Role.DECODE)],
                        make_policy("round_robin"), make_policy("round_robin"))
    for u in pool.all():
        u.health.record(True)
    assert {pool.pick_pair(exclude_decodes=frozenset({"http://d1"})).decode.url for _ in range(4)} == {"http://d2"}
    with pytest.raises(Unavailable, match="no healthy decode server other than http://d1, http://d2"):
        pool.pick_pair(exclude_decodes=frozenset({"http://d1", "http://d2"}))


# ---- servers: a continuation -------------------------------------------------------------------
def test_resume_continues_the_budget_and_refuses_what_it_cannot_continue(tok):
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 4},
            RESUME_FIELD: {"ids": [7, 8, 9]}}
    it = parse_generate(body, tok).items[0]
    assert it.input_ids == tok.encode("hello") + [7, 8, 9]
    assert (it.sampling.max_new_tokens, it.sampling.min_new_tokens) == (7, 1)
    it = parse_chat({"messages": [{"role": "user", "content": "hi"}], RESUME_FIELD: {"ids": [3]}}, tok).items[0]
    assert it.sampling.max_new_tokens == (1 << 20) - 1 and not it.max_new_tokens_given  # cut to the context later
    for bad, why in [({"ids": [1, -2]}, "non-negative"), ({"ids": "x"}, "list"), ([1], "object"),
                     ({"ids": [1], "id": 5}, "id must be")]:
        with pytest.raises(BadRequest, match=why):
            parse_resume({RESUME_FIELD: bad})
    with pytest.raises(BadRequest, match="one prompt and n=1"):
        parse_completion({"prompt": "x", "n": 2, RESUME_FIELD: {"ids": [1]}}, tok)
    with pytest.raises(BadRequest, match="nothing is left"):
        parse_generate({**body, RESUME_FIELD: {"ids": list(range(10))}}, tok)


def test_a_resumed_item_counts_its_ids_as_output_not_prompt(tok):
    it = parse_generate({"input_ids": [30, 31], RESUME_FIELD: {"ids": letters("ab")}}, tok).items[0]
    prog = ItemProgress(it, LetterTok())  # type: ignore[arg-type]
    assert prog.output_ids == letters("ab") and prog.text == "ab" and prog.prompt_tokens == 2
    prog.apply(TokenOutput(it.rid, letters("c"), prompt_tokens=4, cached_tokens=4))  # the worker sees 4
    assert prog.prompt_tokens == 2 and prog.cached_tokens == 2 and prog.text == "abc"


# ---- the whole path in-process: cut a stream anywhere, continue it, compare -----------------
def _server_stream(route: Route, body: dict, tok, feed: list[str]) -> bytes:
    """One server's SSE body for `body`, its worker producing `feed` (letters per output)."""
    import asyncio

    parse = {Route.GENERATE: parse_generate, Route.COMPLETIONS: parse_completion, Route.CHAT: parse_chat}[route]
    call = parse(body, tok)
    letter_tok = LetterTok()
    active = ActiveRequest.__new__(ActiveRequest)  # the reply path only: no workers, no metrics
    active.items, active.progress = call.items, {it.rid: ItemProgress(it, letter_tok) for it in call.items}
    prog = active.progress[call.items[0].rid]

    async def events():
        for k, s in enumerate(feed):
            last = k == len(feed) - 1
            prog.apply(TokenOutput(prog.rid, letters(s), finished=last,
                                   finish_reason={"type": "length"} if last else None))
            yield prog
    active.events = events  # type: ignore[method-assign]

    async def run() -> bytes:
        progress = ProgressLines() if route is Route.GENERATE else None
        if route is Route.GENERATE:
            gen = native_events(type("F", (), {"tokenizer": letter_tok})(), call, active, progress)
        else:
            resume = call.items[0].resume
            reply = OpenAIReply(call, letter_tok, "m", route is Route.CHAT,  # type: ignore[arg-type]
                                id=(resume and resume.reply_id) or "", created=(resume and resume.created) or 0)
            reply.resume(active.progress.values())
            gen = openai_events(reply, active, ProgressLines({"id": reply.id, "created": reply.created}))
        return b"".join([chunk async for chunk in gen]) + b"data: [DONE]\n\n"
    return asyncio.run(run())


def _text(route: Route, events: list[dict]) -> str:
    if route is Route.GENERATE:
        return events[-1]["text"]  # cumulative
    key = "delta" if route is Route.CHAT else None
    return "".join((c["choices"][0]["delta"].get("content", "") if key else c["choices"][0]["text"])
                   for c in events if c["choices"])


def _data(raw: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]


BODIES = {Route.GENERATE: {"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 12, "stop": ["xyz"]}},
          Route.COMPLETIONS: {"prompt": [40, 41], "max_tokens": 12, "stop": "xyz",
                              "stream_options": {"include_usage": True}},
          Route.CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stop": ["xyz"],
                       "stream_options": {"include_usage": True}}}
FEED = ["ab", "cx", "y", "d", "ef", "gh", "ij"]  # "xy" is held back as a possible "xyz", then shown
ANSWER = "".join(FEED)


@pytest.mark.parametrize("route", list(Route))
@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_a_stream_cut_after_any_event_and_continued_shows_the_uninterrupted_stream(tok, route, cut):
    body = {**BODIES[route], "stream": True}
    m = Migration(blocker(inspect_request(route, dict(body)), body))
    whole = _server_stream(route, request_body(body, m, True), tok, FEED)

    first = StreamRelay(m, DECODE)
    events = whole.split(b"\n\n")
    shown = first.feed(b"\n\n".join(events[:cut]) + b"\n\n")  # the decode dies after `cut` events
    assert first.failure is None and not m.done
    second_body = continuation(body, m, True)
    assert second_body[RESUME_FIELD]["ids"] == letters(ANSWER)[:len(m.ids)]
    rest = ANSWER[len(m.ids):]
    second = StreamRelay(m, DECODE)
    shown += second.feed(_server_stream(route, second_body, tok, [rest[k:k + 2] for k in range(0, len(rest), 2)]))
    assert second.saw_done and m.done

    want, got = _data(StreamRelay(Migration(), DECODE).feed(whole)), _data(shown)
    assert _text(route, got) == _text(route, want) == "abcxydefghij"
    assert m.ids == letters("abcxydefghij")
    if route is Route.GENERATE:
        assert got[-1]["output_ids"] == want[-1]["output_ids"]
        assert got[-1]["meta_info"]["completion_tokens"] == 12 and got[-1]["meta_info"]["prompt_tokens"] == 2
        assert len({e["meta_info"]["id"] for e in got}) == 1
    else:
        assert got[-1]["usage"] == want[-1]["usage"] and got[-1]["usage"]["completion_tokens"] == 12
        assert len({(e["id"], e["created"]) for e in got}) == 1  # one reply to the client
        if route is Route.CHAT:
            assert sum("role" in e["choices"][0]["delta"] for e in got if e["choices"]) == 1
