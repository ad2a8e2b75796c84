"""Structured logs: one line per event, key=value or JSON, every line carrying role and server
instance id, worker lines their DP rank, handoff lines their room. Formatters in-process, then
a real PD pair (prefill dp 1 in text, decode dp 1 in JSON) serving one request."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re

import pytest

from pdserve.core.log_format import (  # noqa: E402
    QUIET_LIBRARIES,
    ContextFilter,
    LogContext,
    configure_logging,
    fields,
    make_formatter,
)
from tests.harness.cluster import Server, pd_body, post_both, run  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_text(line: str) -> dict:
    """A key=value line back into a dict (quoted values are JSON strings)."""
    out = {}
    for key, raw in KV.findall(line):
        out[key] = json.loads(raw) if raw.startswith('"') else raw
    assert " ".join(f"{k}={v}" for k, v in KV.findall(line)) == line, line  # nothing but pairs
    return out


def emit(fmt: str, ctx: LogContext, msg: str, args: tuple, **extra) -> str:
    """One record through the context filter and the formatter, as a configured handler does."""
    record = logging.LogRecord("pdserve.test", logging.WARNING, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    ContextFilter(ctx).filter(record)
    return make_formatter(fmt).format(record)


def test_text_and_json_lines_carry_context_and_event_fields():
    ctx = LogContext("decode", "abc123", 1)
    text = emit("text", ctx, "handoff failed for %s", ("x y",), room=42, reason='said "no"\nthen left', s=0.5)
    kv = parse_text(text)
    assert (kv["level"], kv["role"], kv["instance"], kv["dp_rank"], kv["logger"]) == \
        ("warning", "decode", "abc123", "1", "pdserve.test")
    assert (kv["msg"], kv["room"], kv["reason"], kv["s"]) == \
        ("handoff failed for x y", "42", 'said "no"\nthen left', "0.5")
    assert "\n" not in text
    js = json.loads(emit("json", ctx, "ok %d", (3,), room=42, timeline={"stages": [1]}))
    assert (js["msg"], js["room"], js["dp_rank"], js["timeline"]) == ("ok 3", 42, 1, {"stages": [1]})
    assert list(js)[:6] == ["ts", "level", "role", "instance", "dp_rank", "logger"]
    front = json.loads(emit("json", LogContext("prefill", "abc123"), "x", ()))
    assert "dp_rank" not in front and "room" not in front  # only where there is one


def test_configure_logging_owns_the_root_handler():
    root = logging.getLogger()
    saved = root.handlers[:], root.level, [logging.getLogger(n).level for n in QUIET_LIBRARIES]
    buf = io.StringIO()
    try:
        configure_logging("info", "json", LogContext("router", "r1"), stream=buf)
        logging.getLogger("pdserve.x").info("event", extra=fields(room=5, rid=None))
        logging.getLogger("pdserve.x").debug("hidden")
        logging.getLogger("httpx").info("HTTP Request: GET ...")  # library chatter stays out
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, level in zip(QUIET_LIBRARIES, saved[2]):
            logging.getLogger(name).setLevel(level)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert (rec["role"], rec["instance"], rec["msg"], rec["room"]) == ("router", "r1", "event", 5)
    assert "rid" not in rec
    with pytest.raises(ValueError):
        make_formatter("xml")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Serve one PD request, stop both servers, return their log lines and the reply."""
    work = str(tmp_path_factory.mktemp("logging"))
    model = make_tiny_model(os.path.join(work, "tiny"))
    p = Server("prefill", model, dp=1, log_dir=work, extra=["--log-level", "debug", "--log-format", "text"])
    d = Server("decode", model, dp=1, log_dir=work, extra=["--log-level", "info", "--log-format", "json"])
    try:
        p.wait_ready()
        d.wait_ready()
        room = random.getrandbits(63)
        body = pd_body({"text": "hello", "sampling_params": {"max_new_tokens": 3}}, p, room)
        rp, rd = run(post_both(p, d, body))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        infos = (p.info(), d.info())
    finally:
        p.stop()
        d.stop()
    read = lambda s: [ln.rstrip("\n") for ln in open(s.log_path) if ln.strip()]  # noqa: E731
    return {"room": room, "prefill": read(p), "decode": read(d), "info": infos}


@pytest.mark.e2e
def test_every_server_line_is_structured_with_role_instance_rank_and_room(logs):
    p_lines = [parse_text(ln) for ln in logs["prefill"]]
    d_lines = [json.loads(ln) for ln in logs["decode"]]
    for lines, role, info in ((p_lines, "prefill", logs["info"][0]), (d_lines, "decode", logs["info"][1])):
        assert lines, role
        assert {ln["role"] for ln in lines} == {role}
        assert {ln["instance"] for ln in lines} == {info["instance_id"]}  # front and workers alike
        handoff = [ln for ln in lines if ln["logger"] == "pdserve.handoff"]  # worker lines
        assert [(ln["msg"], str(ln["room"]), str(ln["dp_rank"])) for ln in handoff] == \
            [("handoff ok", str(logs["room"]), "0")], handoff
    writes = [ln for ln in p_lines if ln["msg"] == "kv write"]  # debug: only on the prefill
    assert [(ln["room"], ln["dp_rank"]) for ln in writes] == [(str(logs["room"]), "0")]
    assert not any(ln["level"] == "debug" for ln in d_lines)
    assert any("Uvicorn running" in ln["msg"] for ln in d_lines)  # the HTTP server's own lines too


def test_text_parser_rejects_free_text():
    with pytest.raises(AssertionError):
        parse_text("INFO:     Started server process [1]")
    assert parse_text('a=1 b="x y"') == {"a": "1", "b": "x y"}
