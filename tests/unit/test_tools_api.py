"""Tools, reasoning and the rest of the serving API, in process: tool-call parsers (Hermes,
Llama 3 JSON) and reasoning parsers on forced outputs, streamed deltas that concatenate to the
whole message (checked with the official openai client's own stream accumulator), tools and
history in the chat template, message roles, refused fields, generation_config defaults,
served model names, /tokenize, /detokenize and /abort_request's bookkeeping."""

from __future__ import annotations

import json
import os

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pdserve.core.config import ServerConfig, add_dataclass_args, config_from_json, config_to_json, dataclass_from_args
from pdserve.core.errors import BadRequest
from pdserve.core.messages import TokenOutput
from pdserve.server.api_options import ApiOptions, ModelNotFound
from pdserve.server.chat_output import ChatOutput, ChatShape
from pdserve.server.openai_api import OpenAIReply
from pdserve.server.openai_protocol import parse_chat, parse_completion
from pdserve.server.protocol import parse_generate
from pdserve.server.reasoning import REASONING_PARSERS
from pdserve.server.request_state import ItemProgress
from pdserve.server.sampling_defaults import load_sampling_defaults
from pdserve.server.tokenize_api import detokenize, tokenize
from pdserve.server.tokenizer import ServerTokenizer
from pdserve.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolCall, detect_tool_parser
from pdserve.server.tools import RequiredCallsParser
from tests.harness.fake_worker import CHATML_TEMPLATE, write_fake_model
from tests.harness.tool_templates import HERMES_TEMPLATE, TIME_TOOL, WEATHER_TOOL, use_template

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
UTC = ToolCall("get_time", '{"zone": "UTC"}')
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("hermes"))
    write_fake_model(d)
    return use_template(d)


@pytest.fixture(scope="module")
def tok(model_dir) -> ServerTokenizer:
    return ServerTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def opts(model_dir, tok) -> ApiOptions:
    return ApiOptions.build(("tiny", "alias"), "auto", model_dir, tok.chat_template.source, "", "qwen3")


def assert_prefix_monotone(parser, text: str) -> None:
    """Every partial split is a prefix of the final one (what makes streaming == whole)."""
    final = parser.split(text, True)
    for k in range(len(text) + 1):
        part = parser.split(text[:k], False)
        fields = (part.content, part.calls) if hasattr(part, "calls") else (part.reasoning, part.content)
        whole = (final.content, final.calls) if hasattr(final, "calls") else (final.reasoning, final.content)
        assert whole[0].startswith(fields[0]) and whole[1][:len(fields[1])] == fields[1], (k, part, final)


# ---- tool parsers -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls", [
    ("Hello there", "Hello there", ()),
    (CALL, "", (PARIS,)),
    ("Let me check.\n" + CALL + "\n" + CALL2 + "\n", "Let me check.\n", (PARIS, UTC)),
    (CALL + "\nDone?", "\nDone?", (PARIS,)),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", ()),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', "", (ToolCall("f", '{"a": 1}'),)),  # unclosed at EOS
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', "", (ToolCall("f", '{"a": 2}'),)),
    ("a < b and <tool", "a < b and <tool", ()),
])
def test_hermes_parser(text, content, calls):
    p = HermesToolParser()
    assert p.split(text, True) == type(p.split("", True))(content, calls)
    assert_prefix_monotone(p, text)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", (PARIS,)),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}', "", (PARIS, UTC)),
    ("The weather is fine.", "The weather is fine.", ()),
    ('{"answer": 42}', '{"answer": 42}', ()),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}} and more', "and more", (PARIS,)),
])
def test_llama3_json_parser(text, content, calls):
    p = Llama3JsonToolParser()
    got = p.split(text, True)
    assert (got.content, got.calls) == (content, calls)
    assert_prefix_monotone(p, text)


def test_parser_detected_from_the_template():
    assert isinstance(detect_tool_parser(HERMES_TEMPLATE), HermesToolParser)
    assert detect_tool_parser(CHATML_TEMPLATE) is None  # no tools in it
    llama = "{% if tools %}{{ tools | tojson }} respond as {\"name\": n, \"parameters\": p}{% endif %}"
    assert isinstance(detect_tool_parser(llama), Llama3JsonToolParser)


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nhmm</think>\n\nParis.", "\nhmm", "\n\nParis."),
    ("qwen3", "Paris.", "", "Paris."),  # thinking off: no reasoning
    ("qwen3", "<think>still thinking", "still thinking", ""),  # cut by max_tokens
    ("deepseek_r1", "hmm, so</think>Paris.", "hmm, so", "Paris."),  # <think> was in the prompt
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "all reasoning", "all reasoning", ""),
])
def test_reasoning_parsers(name, text, reasoning, content):
    p = REASONING_PARSERS[name]
    got = p.split(text, True)
    assert (got.reasoning, got.content) == (reasoning, content)
    assert_prefix_monotone(p, text)


# ---- replies: whole and streamed ----------------------------------------------------------------

def run_reply(tok, call, text: str, finish: dict | None = None, per_token: bool = True):
    """Feed `text` token by token to a reply; (whole reply, streamed chunks)."""
    reply = OpenAIReply(call, tok, "tiny", True)
    prog = ItemProgress(call.items[0], tok)
    ids = tok.encode(text, add_special_tokens=False)
    chunks = []
    steps = [[t] for t in ids] if per_token else [ids]
    for k, step in enumerate(steps):
        last = k == len(steps) - 1
        prog.apply(TokenOutput(prog.rid, step, finished=last,
                               finish_reason=(finish or {"type": "stop", "matched": None}) if last else None))
        chunk = reply.chunk(prog)
        if chunk is not None:
            chunks.append(chunk)
    return reply.full([prog]), chunks


def accumulate(chunks) -> dict:
    """The official openai client's own accumulation of the streamed chunks."""
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    return state.current_completion_snapshot.model_dump()


@pytest.mark.parametrize("text", [CALL, "Let me check.\n" + CALL + "\n" + CALL2, "No tools needed."])
def test_tool_calls_whole_and_streamed_agree(tok, opts, text):
    call = parse_chat({"messages": USER, "tools": [WEATHER_TOOL, TIME_TOOL], "stream": True}, tok, opts)
    full, chunks = run_reply(tok, call, text)
    msg = full["choices"][0]["message"]
    want = HermesToolParser().split(text, True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []] == \
        [(c.name, c.arguments) for c in want.calls]
    assert msg["content"] == (want.content or None if want.calls else want.content)
    assert full["choices"][0]["finish_reason"] == ("tool_calls" if want.calls else "stop")
    snap = accumulate(chunks)["choices"][0]
    assert (snap["message"]["content"] or "") == (msg["content"] or "")
    streamed = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in snap["message"]["tool_calls"] or []]
    assert [s[1:] for s in streamed] == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                         for c in msg.get("tool_calls") or []]
    assert all(s[0].startswith("call_") for s in streamed) and len({s[0] for s in streamed}) == len(streamed)
    assert snap["finish_reason"] == full["choices"][0]["finish_reason"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    for d in deltas:  # OpenAI's delta shape: index, id, type, function{name, arguments}
        for tc in d.get("tool_calls") or ():
            assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"


def test_tool_choice_none_is_not_parsed_and_auto_is_the_default(tok, opts):
    call = parse_chat({"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "none"}, tok, opts)
    full, _ = run_reply(tok, call, CALL, per_token=False)
    assert full["choices"][0]["message"]["content"] == CALL and "tool_calls" not in full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "stop"
    assert '"get_weather"' in tok.decode(call.items[0].input_ids, skip_special_tokens=False)  # still shown
    auto = parse_chat({"messages": USER, "tools": [WEATHER_TOOL]}, tok, opts)
    assert auto.shape.tools is not None


def test_reasoning_content_whole_and_streamed(tok, opts):
    call = parse_chat({"messages": USER, "tools": [WEATHER_TOOL], "stream": True}, tok, opts)
    text = "<think>I should call it.</think>\n" + CALL
    full, chunks = run_reply(tok, call, text)
    msg = full["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should call it." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    assert streamed == "I should call it."
    plain = parse_chat({"messages": USER}, tok, opts)
    full, chunks = run_reply(tok, plain, "<think>x</think>Paris")
    assert full["choices"][0]["message"]["reasoning_content"] == "x"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Paris"
    no_parser = parse_chat({"messages": USER}, tok, ApiOptions())
    assert no_parser.shape.plain


def test_length_cut_tool_call_stays_content(tok, opts):
    call = parse_chat({"messages": USER, "tools": [WEATHER_TOOL], "max_tokens": 5}, tok, opts)
    text = CALL[:20]
    full, _ = run_reply(tok, call, text, finish={"type": "length", "length": 5})
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["choices"][0]["message"]["content"] == text  # an unclosed, unparseable call is shown as text


# ---- the prompt side ----------------------------------------------------------------------------

def test_tools_and_tool_history_reach_the_template(tok, opts):
    msgs = [*USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    call = parse_chat({"messages": msgs, "tools": [WEATHER_TOOL]}, tok, opts)
    prompt = tok.decode(call.items[0].input_ids, skip_special_tokens=False)
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in prompt
    # arguments decoded to an object before templating: the template's tojson writes it once
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert prompt == tok.apply_chat_template(
        [USER[0], {**msgs[1], "content": "", "tool_calls": [{**msgs[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Rome"}}}]}, msgs[2]], True, [WEATHER_TOOL])


@pytest.mark.parametrize("body, match", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "role 'function'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] \(user\) needs content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only assistant"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}, "not valid JSON"),
    ({"messages": USER, "tools": [{"type": "function"}]}, r"tools\[0\]"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "function.name"),
    ({"messages": USER, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "twice"),
    ({"messages": USER, "tool_choice": "auto"}, "needs a non-empty tools"),
    ({"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice 'sometimes'"),
    ({"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "not in tools"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions is not supported"),
    ({"messages": USER, "function_call": "auto"}, "function_call is not supported"),
])
def test_bad_messages_and_tools_are_400s(tok, opts, body, match):
    with pytest.raises(BadRequest, match=match):
        parse_chat(body, tok, opts)


def test_tools_need_a_template_that_takes_them_and_a_parser(tmp_path):
    d = str(tmp_path)
    write_fake_model(d)  # ChatML without tools
    tok = ServerTokenizer.from_dir(d)
    plain = ApiOptions.build((), "auto", d, tok.chat_template.source)
    with pytest.raises(BadRequest, match="does not take tools"):
        parse_chat({"messages": USER, "tools": [WEATHER_TOOL]}, tok, plain)
    assert parse_chat({"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "none"}, tok, plain).items
    takes = ApiOptions(template_takes_tools=True)  # a template with tools but no known format
    with pytest.raises(BadRequest, match="--tool-call-parser"):
        parse_chat({"messages": USER, "tools": [WEATHER_TOOL]}, tok, takes)


def test_forced_tool_choice_is_a_grammar(tok, opts):
    named = parse_chat({"messages": USER, "tools": [WEATHER_TOOL, TIME_TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, tok, opts)
    g = named.items[0].sampling.grammar
    assert g is not None and g.kind.value == "json_schema"
    assert json.loads(g.text) == WEATHER_TOOL["function"]["parameters"]
    full, _ = run_reply(tok, named, '{"city": "Rome"}', per_token=False)
    ch = full["choices"][0]
    assert ch["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert ch["message"]["content"] is None and ch["finish_reason"] == "stop"  # OpenAI: forced name -> stop
    req = parse_chat({"messages": USER, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required"}, tok, opts)
    schema = json.loads(req.items[0].sampling.grammar.text)
    assert schema["type"] == "array" and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}]'
    assert RequiredCallsParser().split(text, True).calls == (ToolCall("get_time", '{"zone": "CET"}'),)
    full, _ = run_reply(tok, req, text, per_token=False)
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    with pytest.raises(BadRequest, match="cannot be combined"):
        parse_chat({"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "required",
                    "response_format": {"type": "json_object"}}, tok, opts)


def test_chat_output_message_and_deltas_share_one_parse():
    out = ChatOutput(ChatShape(REASONING_PARSERS["deepseek_r1"], HermesToolParser()))
    text = "plan</think>ok " + CALL
    parts = [out.delta(text[:k], False) for k in range(len(text))] + [out.delta(text, True)]
    assert "".join(p.get("reasoning_content", "") for p in parts) == "plan"
    assert "".join(p.get("content", "") for p in parts) == "ok "
    assert sum(len(p.get("tool_calls", ())) for p in parts) == 1
    assert ChatOutput(out.shape).message(text)["tool_calls"][0]["function"]["name"] == "get_weather"


# ---- refused fields, defaults, names ------------------------------------------------------------

@pytest.mark.parametrize("route, extra, field", [
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("chat", {"bad_words": ["x"]}, "bad_words"),
    ("completion", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"return_hidden_states": True}, "return_hidden_states"),
    ("completion", {"lora_path": "a"}, "lora_path"),
    ("generate", {"return_hidden_states": True}, "return_hidden_states"),
    ("generate", {"token_ids_logprob": [1]}, "token_ids_logprob"),
    ("generate", {"lora_path": "x"}, "lora_path"),
    ("generate", {"logprob_start_len": 3}, "logprob_start_len"),
])
def test_known_unsupported_fields_are_refused(tok, route, extra, field):
    parse, base = {"chat": (parse_chat, {"messages": USER}), "completion": (parse_completion, {"prompt": "x"}),
                   "generate": (parse_generate, {"text": "x"})}[route]
    with pytest.raises(BadRequest) as e:
        parse({**base, **extra}, tok)
    assert field in e.value.message and "is not supported by this server" in e.value.message
    noop = {k: (False if isinstance(v, bool) else None) for k, v in extra.items()}
    assert parse({**base, **noop}, tok).items  # the no-op spelling is served


def test_sampling_seed_is_the_seed(tok):
    assert parse_generate({"text": "x", "sampling_params": {"sampling_seed": 7}}, tok).items[0].sampling.seed == 7
    with pytest.raises(BadRequest, match="disagree"):
        parse_generate({"text": "x", "sampling_params": {"sampling_seed": 7, "seed": 8}}, tok)


def test_generation_config_defaults(tmp_path, tok):
    d = str(tmp_path)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                   "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}, f)
    defaults = load_sampling_defaults("auto", d)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7}
    assert load_sampling_defaults("vllm", d) == {} and load_sampling_defaults(d, "/nonexistent") == defaults
    opts = ApiOptions(sampling_defaults=defaults)
    for parse, base in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "x"}),
                        (parse_generate, {"text": "x"})):
        it = parse(base, tok, opts).items[0]
        sp = it.sampling
        assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_new_tokens) == (0.6, 0.9, 20, 1.1, 7)
        assert not it.max_new_tokens_given  # a default may still be cut to the context
    mine = parse_chat({"messages": USER, "temperature": 0, "max_tokens": 3, "top_k": -1}, tok, opts).items[0].sampling
    assert (mine.temperature, mine.max_new_tokens, mine.top_k, mine.top_p) == (0.0, 3, -1, 0.9)
    sp = parse_generate({"text": "x", "sampling_params": {"temperature": 1.0}}, tok, opts).items[0].sampling
    assert (sp.temperature, sp.top_k) == (1.0, 20)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"temperature": -1}, f)
    with pytest.raises(ValueError, match="temperature"):
        load_sampling_defaults("auto", d)
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path / "nowhere"), d)


def test_served_model_names_and_404(opts):
    assert opts.check_model("alias") == "alias" and opts.check_model(None) == "tiny"
    with pytest.raises(ModelNotFound) as e:
        opts.check_model("gpt-4")
    err = e.value.to_json()["error"]
    assert e.value.status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert "'gpt-4'" in err["message"] and "tiny" in err["message"]


def test_served_model_name_flag_takes_several_names():
    import argparse
    p = argparse.ArgumentParser()
    add_dataclass_args(p, ServerConfig)
    cfg = dataclass_from_args(ServerConfig, p.parse_args(["--served-model-name", "a", "b", "--tool-call-parser",
                                                          "hermes", "--reasoning-parser", "qwen3"]))
    assert cfg.served_model_name == ("a", "b") and cfg.tool_call_parser == "hermes"
    assert config_from_json(config_to_json(cfg)) == cfg
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "mistral"])
    with pytest.raises(ValueError, match="not supported"):
        ApiOptions.build((), "vllm", "/tmp", None, "mistral")


def test_tokenize_and_detokenize(tok, opts):
    out = tokenize({"prompt": "Paris", "return_token_strs": True}, tok, opts, 256)
    assert out["tokens"] == tok.encode("Paris") and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]) == "Paris" and out["max_model_len"] == 256
    chat = tokenize({"messages": USER, "tools": [WEATHER_TOOL], "model": "tiny"}, tok, opts, 256)
    assert chat["tokens"] == parse_chat({"messages": USER, "tools": [WEATHER_TOOL]}, tok, opts).items[0].input_ids
    assert chat["token_strs"] is None
    assert detokenize({"tokens": out["tokens"]}, tok, opts) == {"prompt": "Paris"}
    for bad, match in (({"tokens": [10 ** 6]}, "outside the vocabulary"), ({"tokens": "x"}, "tokens")):
        with pytest.raises(BadRequest, match=match):
            detokenize(bad, tok, opts)
    with pytest.raises(BadRequest, match="either prompt or messages"):
        tokenize({}, tok, opts, 256)
    with pytest.raises(ModelNotFound):
        tokenize({"prompt": "x", "model": "other"}, tok, opts, 256)


def test_strict_tools_need_a_forced_choice(tok, opts):
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    with pytest.raises(BadRequest, match="strict tools with tool_choice 'auto'"):
        parse_chat({"messages": USER, "tools": [strict]}, tok, opts)
    assert parse_chat({"messages": USER, "tools": [strict], "tool_choice": "required"}, tok, opts).items


def test_parallel_tool_calls_false_allows_one_call(tok, opts):
    body = {"messages": USER, "tools": [WEATHER_TOOL, TIME_TOOL], "parallel_tool_calls": False}
    full, _ = run_reply(tok, parse_chat(body, tok, opts), CALL + CALL2, per_token=False)
    assert [c["function"]["name"] for c in full["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    req = parse_chat({**body, "tool_choice": "required"}, tok, opts)
    assert json.loads(req.items[0].sampling.grammar.text)["maxItems"] == 1
    with pytest.raises(BadRequest, match="parallel_tool_calls"):
        parse_chat({**body, "parallel_tool_calls": "no"}, tok, opts)


def test_sglang_reasoning_switches(tok, opts):
    text = "<think>abc</think>Paris"
    off = parse_chat({"messages": USER, "separate_reasoning": False}, tok, opts)
    full, _ = run_reply(tok, off, text)
    assert full["choices"][0]["message"]["content"] == text and "reasoning_content" not in full["choices"][0]["message"]
    held = parse_chat({"messages": USER, "stream_reasoning": False, "stream": True}, tok, opts)
    _, chunks = run_reply(tok, held, text)
    parts = [c["choices"][0]["delta"]["reasoning_content"] for c in chunks
             if "reasoning_content" in c["choices"][0]["delta"]]
    assert parts == ["abc"]  # one delta, once the reasoning ended


def test_abort_request_finds_a_request_and_its_samples():
    from types import SimpleNamespace

    from pdserve.server.running import RunningRequests

    class Active:
        def __init__(self, *rids):
            self.items = [SimpleNamespace(rid=r) for r in rids]
            self.aborted: list[str] = []

        def abort_item(self, rid, reason):
            self.aborted.append(rid)
            return True

    running = RunningRequests()
    a, b = Active("q_0", "q_1"), Active("q_10x")
    running.add(a)
    running.add(b)
    assert running.abort("q") == ["q_0", "q_1"] and b.aborted == []  # n > 1: rid R -> R_0, R_1
    assert running.abort("q_10x") == ["q_10x"] and running.abort("nope") == []
    running.remove(a)
    assert running.abort(None, abort_all=True) == ["q_10x"]


def test_chat_template_kwargs_cannot_replace_the_request(tok, opts):
    assert parse_chat({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, tok, opts).items
    with pytest.raises(BadRequest, match="must not set \\['tools'\\]"):
        parse_chat({"messages": USER, "chat_template_kwargs": {"tools": []}}, tok, opts)


def test_streamed_parts_equal_the_message_on_random_texts():
    """Random mixes of tags, JSON and text: for every parser combination the deltas add up to
    the non-streamed message (reasoning, content and calls)."""
    import random
    rng = random.Random(7)
    pieces = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "{bad", "\n", " ", "hi", "<",
              "<tool", "</think>", "<think>", '{"name": "g", "parameters": {}}', ";", "<|python_tag|>"]
    shapes = [ChatShape(None, HermesToolParser()), ChatShape(None, Llama3JsonToolParser()),
              ChatShape(REASONING_PARSERS["qwen3"], HermesToolParser()),
              ChatShape(REASONING_PARSERS["deepseek_r1"], Llama3JsonToolParser())]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for shape in shapes:
            out = ChatOutput(shape)
            parts = [out.delta(text[:k], False) for k in range(len(text))] + [out.delta(text, True)]
            msg = ChatOutput(shape).message(text)
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for p in parts for c in p.get("tool_calls", ())]
            assert ("".join(p.get("reasoning_content", "") for p in parts),
                    "".join(p.get("content", "") for p in parts),
                    calls) == (msg.get("reasoning_content") or "", msg["content"] or "",
                               [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", ())])


def test_a_grammar_answer_is_not_split_as_reasoning(model_dir, tok):
    r1 = ApiOptions.build(("tiny",), "auto", model_dir, tok.chat_template.source, "", "deepseek_r1")
    named = parse_chat({"messages": USER, "tools": [WEATHER_TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, tok, r1)
    full, _ = run_reply(tok, named, '{"city": "Paris"}', per_token=False)
    assert full["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert parse_chat({"messages": USER}, tok, r1).shape.reasoning is not None
