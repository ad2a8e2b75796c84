"""Request parsing (native and OpenAI bodies -> items), stop strings, and reply shapes,
without processes."""

from __future__ import annotations

import pytest

from pdserve.core.errors import BadRequest
from pdserve.core.messages import ErrorInfo, TokenOutput
from pdserve.core.sampling import SamplingParams
from pdserve.server.openai_api import OpenAIReply
from pdserve.server.openai_protocol import parse_chat, parse_completion
from pdserve.server.protocol import DEFAULT_BOOTSTRAP_PORT, RequestItem, item_reply, parse_generate
from pdserve.server.request_state import ItemProgress, held_back
from pdserve.server.tokenizer import ServerTokenizer
from tests.harness.fake_worker import write_fake_model

ROUTER_BODY = {  # what sglang-router 0.3.2 sends (reference/sglang-router-0.3.2.md)
    "text": "The capital of France is", "model": None,
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
    "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
    "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
    "bootstrap_host": "127.0.0.1", "bootstrap_port": 18991, "bootstrap_room": 471258059256932771}
ROUTER_CHAT_BODY = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}], "model": "m", "logprobs": False,
    "max_completion_tokens": 8, "stream": False, "temperature": 0.0, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "bootstrap_host": "127.0.0.1",
    "bootstrap_port": None, "bootstrap_room": 2400490677657770650}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ServerTokenizer:
    d = tmp_path_factory.mktemp("model")
    write_fake_model(str(d))
    return ServerTokenizer.from_dir(str(d))


def test_router_body_is_accepted(tok):
    call = parse_generate(ROUTER_BODY, tok)
    assert not call.stream and not call.batched and len(call.items) == 1
    it = call.items[0]
    assert it.input_ids == tok.encode("The capital of France is")
    assert it.sampling.max_new_tokens == 8 and it.sampling.greedy and it.max_new_tokens_given
    assert (it.pd.bootstrap_host, it.pd.bootstrap_port, it.pd.bootstrap_room) == ("127.0.0.1", 18991,
                                                                                   471258059256932771)
    chat = parse_chat(ROUTER_CHAT_BODY, tok)
    it = chat.items[0]
    assert it.sampling.max_new_tokens == 8 and it.sampling.temperature == 0.0
    assert it.pd.bootstrap_port == DEFAULT_BOOTSTRAP_PORT and it.pd.bootstrap_room == 2400490677657770650
    assert it.input_ids == tok.encode_chat(ROUTER_CHAT_BODY["messages"])


def test_batches_n_rids_and_rooms(tok):
    call = parse_generate({"text": ["a b", "c"], "sampling_params": {"n": 2, "seed": 5}, "rid": "q",
                           "bootstrap_room": 10, "routed_dp_rank": 1}, tok)
    assert call.batched and [it.index for it in call.items] == [0, 1, 2, 3]
    assert [it.rid for it in call.items] == ["q_0", "q_1", "q_2", "q_3"]
    assert [it.pd.bootstrap_room for it in call.items] == [10, 11, 12, 13]
    assert [it.input_ids == tok.encode("a b") for it in call.items] == [True, True, False, False]
    assert [it.sampling.seed for it in call.items] == [5, 6, 5, 6]
    assert all(it.sampling.n == 1 and it.routed_dp_rank == 1 for it in call.items)
    call = parse_generate({"input_ids": [[1, 2], [3]], "rid": ["x", "y"], "bootstrap_room": [7, 3],
                           "data_parallel_rank": 0, "disagg_prefill_dp_rank": [1, 0]}, tok)
    assert [(it.rid, it.pd.bootstrap_room, it.routed_dp_rank, it.pd.prefill_dp_rank) for it in call.items] == \
        [("x", 7, 0, 1), ("y", 3, 0, 0)]
    single = parse_generate({"input_ids": [4, 5], "sampling_params": {"n": 3}}, tok)
    assert single.batched and len({it.rid for it in single.items}) == 3
    assert parse_generate({"input_ids": [4, 5]}, tok).items[0].max_new_tokens_given is False


@pytest.mark.parametrize("body, match", [
    ({}, "needs text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "either text or input_ids"),
    ({"text": 5}, "text must be"),
    ({"text": []}, "text must be"),
    ({"text": ""}, "must not be empty"),
    ({"text": ["a", ""]}, "must not be empty"),
    ({"input_ids": []}, "must not be empty"),
    ({"input_ids": [1, "2"]}, "list of integers"),
    ({"input_ids": [[1], []]}, "must not be empty"),
    ({"input_ids": [1, True]}, "list of integers"),
    ({"text": "a", "sampling_params": "hot"}, "must be an object"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": [{}, {}]}, "2 entries for 1 prompts"),
    ({"text": "a", "stream": "yes"}, "stream must be a boolean"),
    ({"text": "a", "return_logprob": 1}, "return_logprob must be a boolean"),
    ({"text": "a", "rid": 5}, "rid must be"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "unique"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid has 1 entries"),
    ({"text": "a", "bootstrap_room": "x"}, "bootstrap_room must be an integer"),
    ({"text": "a", "bootstrap_room": -1}, "out of range"),
    ({"text": "a", "bootstrap_room": 2**63}, "out of range"),
    ({"text": ["a", "b"], "bootstrap_room": [1]}, "bootstrap_room has 1 entries"),
    ({"text": "a", "sampling_params": {"n": 2}, "bootstrap_room": [1]}, "one per prompt and per sample"),
    ({"text": "a", "bootstrap_port": "8998"}, "bootstrap_port"),
    ({"text": "a", "bootstrap_port": 70000}, "bootstrap_port"),
    ({"text": "a", "bootstrap_host": 1}, "bootstrap_host"),
    ({"text": "a", "routed_dp_rank": "0"}, "routed_dp_rank"),
    ({"text": "a", "routed_dp_rank": -2}, "routed_dp_rank"),
    ({"text": "a", "disagg_prefill_dp_rank": 1.5}, "disagg_prefill_dp_rank"),
])
def test_bad_native_bodies(tok, body, match):
    with pytest.raises(BadRequest, match=match):
        parse_generate(body, tok)


def test_openai_fields_map_to_sampling(tok):
    c = parse_completion({"prompt": ["x y", "z"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                          "top_k": 3, "min_p": 0.1, "stop": "\n", "seed": 3, "n": 2, "logprobs": 0,
                          "stream": True, "stream_options": {"include_usage": True}, "user": "ignored",
                          "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                          "logit_bias": {"5": -100, "17": 2.5}}, tok)
    sp = c.items[0].sampling
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.stop, sp.seed) == \
        (7, 0.5, 0.9, 3, 0.1, ("\n",), 3)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.logit_bias) == \
        (0.5, -1.0, 1.2, ((5, -100.0), (17, 2.5)))
    assert c.n == 2 and len(c.items) == 4 and c.logprobs and c.stream and c.include_usage
    assert parse_completion({"prompt": [1, 2, 3]}, tok).items[0].input_ids == [1, 2, 3]
    assert [it.input_ids for it in parse_completion({"prompt": [[1], [2, 3]]}, tok).items] == [[1], [2, 3]]
    default = parse_completion({"prompt": "x"}, tok).items[0]
    assert default.sampling.max_new_tokens == 16 and not default.max_new_tokens_given
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
                       "max_tokens": 4, "max_completion_tokens": 5, "logprobs": True}, tok)
    it = chat.items[0]
    assert it.sampling.max_new_tokens == 5 and it.return_logprob
    assert it.input_ids == tok.encode_chat([{"role": "user", "content": "a\nb"}])
    assert parse_chat({"messages": [{"role": "user", "content": "a"}]}, tok).items[0].max_new_tokens_given is False


def test_continue_final_message(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    it = parse_chat({"messages": msgs, "continue_final_message": True}, tok).items[0]
    assert tok.decode(it.input_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nHello, I am")


@pytest.mark.parametrize("route, body, match", [
    ("completion", {}, "prompt must be"),
    ("completion", {"prompt": ""}, "must not be empty"),
    ("completion", {"prompt": []}, "prompt must be"),
    ("completion", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completion", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("completion", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completion", {"prompt": "x", "n": 0}, "n="),
    ("completion", {"prompt": "x", "logprobs": "x"}, "logprobs"),
    ("completion", {"prompt": "x", "echo": 1}, "echo must be a boolean"),
    ("completion", {"prompt": "x", "logprobs": 21}, "logprobs=21 is out of range"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("completion", {"prompt": "x", "stream_options": 3}, "stream_options"),
    ("completion", {"prompt": "x", "stop": [1]}, "stop"),
    ("chat", {}, "messages must be"),
    ("chat", {"messages": []}, "messages must be"),
    ("chat", {"messages": [{"content": "x"}]}, "string role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "content must be"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}, "max_completion"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": "f"}, "tools"),
    ("completion", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completion", {"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    ("completion", {"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ("completion", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("completion", {"prompt": "x", "logit_bias": {"tok": 1}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": "x"}}, "logit_bias"),
    ("completion", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("completion", {"prompt": "x", "min_tokens": 20}, "min_tokens=20 must not exceed max_tokens=16"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 9, "max_completion_tokens": 8},
     "min_tokens=9 must not exceed max_completion_tokens=8"),
])
def test_bad_openai_bodies(tok, route, body, match):
    parse = parse_chat if route == "chat" else parse_completion
    with pytest.raises(BadRequest, match=match):
        parse(body, tok)


MSGS = [{"role": "user", "content": "x"}]
UNSUPPORTED = [  # (route, extra body fields, the field the 400 names)
    # structured outputs work (tests/unit/test_structured_outputs.py) except structural tags
    ("both", {"response_format": {"type": "structural_tag"}}, "structural_tag"),
    ("both", {"structural_tag": "{}"}, "structural_tag"),
    # tools / tool_choice: tests/unit/test_tools_api.py
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("completion", {"suffix": " end"}, "suffix"),
    ("both", {"best_of": 2}, "best_of"),
    ("both", {"n": 2, "best_of": 3}, "best_of"),
    ("both", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("both", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ("both", {"min_tokens": 2, "max_tokens": 8, "stop": ["x"]}, "min_tokens together with stop"),
]


def _cases(table):
    for route, extra, field in table:
        for r in (("completion", "chat") if route == "both" else (route,)):
            yield pytest.param(r, extra, field, id=f"{r}-{field}-{len(str(extra))}")


@pytest.mark.parametrize("route, extra, field", list(_cases(UNSUPPORTED)))
def test_unsupported_openai_fields_are_refused_naming_the_field(tok, route, extra, field):
    parse, base = (parse_chat, {"messages": MSGS}) if route == "chat" else (parse_completion, {"prompt": "x"})
    with pytest.raises(BadRequest) as e:
        parse({**base, **extra}, tok)
    assert field in e.value.message and "is not supported by this server" in e.value.message, e.value.message


def test_no_op_values_of_unsupported_fields_are_accepted(tok):
    chat = parse_chat({"messages": MSGS, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                       "logprobs": True, "top_logprobs": 0, "best_of": 2, "n": 2, "functions": [],
                       "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False},
                       "guided_json": None, "chat_template": None, "min_tokens": 3, "max_tokens": 5}, tok)
    assert chat.n == 2 and chat.include_usage and chat.items[0].sampling.min_new_tokens == 3
    comp = parse_completion({"prompt": "x", "logprobs": 0, "echo": False, "suffix": None, "best_of": 1,
                             "response_format": {"type": "text"}}, tok)
    assert comp.logprobs and comp.items[0].return_logprob
    assert parse_completion({"prompt": "x", "suffix": ""}, tok).items[0].sampling.max_new_tokens == 16


def test_native_sampling_params_penalties_and_refusals(tok):
    sp = parse_generate({"text": "a", "sampling_params": {
        "presence_penalty": 1.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "min_new_tokens": 4,
        "max_new_tokens": 9, "logit_bias": {"3": 10}}}, tok).items[0].sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_new_tokens, sp.logit_bias) == \
        (1.5, 0.25, 1.1, 4, ((3, 10.0),))
    assert sp.processes_logits and not parse_generate({"text": "a"}, tok).items[0].sampling.processes_logits
    for key, val in (("structural_tag", "{}"), ("stop_regex", "a+")):  # json_schema/regex/ebnf work
        with pytest.raises(BadRequest, match=f"sampling_params.{key} is not supported by this server"):
            parse_generate({"text": "a", "sampling_params": {key: val}}, tok)
    assert parse_generate({"text": "a", "return_logprob": True, "top_logprobs_num": 3}, tok).items[0].top_logprobs == 3
    for bad, match in (({"top_logprobs_num": 3}, "needs return_logprob"),
                       ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num=21 is out of range")):
        with pytest.raises(BadRequest, match=match):
            parse_generate({"text": "a", **bad}, tok)
    assert parse_generate({"text": "a", "top_logprobs_num": 0}, tok).items
    for bad, match in (({"presence_penalty": -3}, "sampling_params.presence_penalty"),
                       ({"repetition_penalty": -1}, "sampling_params.repetition_penalty"),
                       ({"min_new_tokens": 200}, "sampling_params.min_new_tokens=200 must not exceed"),
                       ({"min_new_tokens": 2, "max_new_tokens": 1}, "min_new_tokens=2 must not exceed"),
                       ({"min_new_tokens": 1.5}, "sampling_params.min_new_tokens"),
                       ({"logit_bias": {"1": -100.5}}, "sampling_params.logit_bias"),
                       ({"frequency_penalty": 1e999}, "sampling_params.frequency_penalty")):
        with pytest.raises(BadRequest, match=match):
            parse_generate({"text": "a", "sampling_params": bad}, tok)


# ---- stop strings and progress ---------------------------------------------------------------

class LetterTok:
    """id i decodes to one letter; 26 is a special token that decodes to nothing."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 26 else chr(ord("a") + i) for i in ids)

    def token_text(self, i):
        return self.decode([i])


def progress(stop=(), ids=(0,), return_logprob=False) -> ItemProgress:
    it = RequestItem(0, "r", list(ids), SamplingParams(stop=tuple(stop)), True, return_logprob)
    return ItemProgress(it, LetterTok())  # type: ignore[arg-type]


def letters(s: str) -> list[int]:
    return [ord(c) - ord("a") for c in s]


def test_held_back():
    assert held_back("abc", ("cd",)) == 1
    assert held_back("abc", ("bcx", "x")) == 2
    assert held_back("abc", ("zz",)) == 0
    assert held_back("", ("ab",)) == 0


def test_stop_string_across_outputs_trims_text_and_ids():
    p = progress(stop=("xyz", "cde"))
    assert not p.apply(TokenOutput("r", letters("ab")))
    assert p.visible_text() == "ab"
    assert not p.apply(TokenOutput("r", letters("cd")))
    assert p.visible_text() == "ab"  # "cd" may still become "cde"
    assert p.apply(TokenOutput("r", letters("efg")))
    assert p.finished and p.text == "ab" and p.visible_text() == "ab"
    assert p.output_ids == letters("abcde")
    assert p.finish_reason == {"type": "stop", "matched": "cde"}
    assert not p.apply(TokenOutput("r", letters("h"), finished=True))  # late outputs are ignored


def test_earliest_stop_wins_and_no_false_match_before_start():
    p = progress(stop=("b", "cd"))
    assert p.apply(TokenOutput("r", letters("acdb")))
    assert p.text == "a" and p.finish_reason["matched"] == "cd"


def test_matched_stop_token_is_not_text_and_length_finish():
    p = progress()
    p.apply(TokenOutput("r", [0, 1, 26], finished=True, finish_reason={"type": "stop", "matched": 26}))
    assert p.text == "ab" and p.output_ids == [0, 1, 26]
    p = progress()
    p.apply(TokenOutput("r", [2, 3], [-0.5, -0.25], finished=True, finish_reason={"type": "length", "length": 2},
                        prompt_tokens=1, input_logprobs=[None], meta={"k": 1}))
    assert (p.text, p.output_logprobs, p.input_logprobs, p.meta) == ("cd", [-0.5, -0.25], [None], {"k": 1})


def test_worker_error_finishes_with_error():
    p = progress()
    p.apply(TokenOutput("r", finished=True, error=ErrorInfo(503, "room 5: prefill rank 1 gone", "handoff_error")))
    assert p.finished and p.error.status == 503 and p.finish_reason["type"] == "abort"


def test_native_reply_shape():
    p = progress(ids=(0, 1), return_logprob=True)
    assert item_reply(p, LetterTok(), text_in_logprobs=True)["meta_info"]["cached_tokens"] == 0  # type: ignore
    p.apply(TokenOutput("r", [2], [-0.5], prompt_tokens=2, cached_tokens=1, input_logprobs=[None, -1.0],
                        meta={"dp_rank": 1}))
    p.apply(TokenOutput("r", [3], [-0.25], finished=True, finish_reason={"type": "length", "length": 2}))
    out = item_reply(p, LetterTok(), text_in_logprobs=True)  # type: ignore[arg-type]
    assert out["text"] == "cd" and out["output_ids"] == [2, 3]
    m = out["meta_info"]
    assert (m["id"], m["prompt_tokens"], m["completion_tokens"], m["dp_rank"]) == ("r", 2, 2, 1)
    assert m["cached_tokens"] == 1  # kept from the first output (later ones say 0)
    assert m["finish_reason"] == {"type": "length", "length": 2} and m["e2e_latency"] >= 0
    assert m["input_token_logprobs"] == [[None, 0, "a"], [-1.0, 1, "b"]]
    assert m["output_token_logprobs"] == [[-0.5, 2, "c"], [-0.25, 3, "d"]]
    assert "index" not in out and item_reply(p, LetterTok(), False, index=3)["index"] == 3  # type: ignore


@pytest.mark.parametrize("chat", [False, True])
def test_openai_stream_deltas_concatenate_to_full(tok, chat):
    body = {"prompt": "x", "n": 2, "stop": ["cde"], "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "stop": ["cde"], "logprobs": True,
                "stream": True, "stream_options": {"include_usage": True}}
    call = (parse_chat if chat else parse_completion)(body, tok)
    reply = OpenAIReply(call, LetterTok(), "m", chat)  # type: ignore[arg-type]
    progs = [ItemProgress(it, LetterTok()) for it in call.items]  # type: ignore[arg-type]
    feed = [(0, "ab"), (1, "xy"), (0, "cd"), (1, "z"), (0, "ef")]
    chunks = []
    for k, s in feed:  # the worker reports 16 cached prompt tokens; n=2 samples count the prompt once
        progs[k].apply(TokenOutput(progs[k].rid, letters(s), [-0.5] * len(s), cached_tokens=16))
        chunks.append(reply.chunk(progs[k]))
    progs[1].apply(TokenOutput(progs[1].rid, [], finished=True, finish_reason={"type": "length", "length": 3}))
    chunks.append(reply.chunk(progs[1]))
    chunks = [c for c in chunks if c is not None]
    full = reply.full(progs)
    key = "delta" if chat else None
    for k in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        text = "".join((ch["delta"]["content"] if key else ch["text"]) for ch in mine)
        want = full["choices"][k]["message"]["content"] if chat else full["choices"][k]["text"]
        assert text == want == ["ab", "xyz"][k]
        assert [ch["finish_reason"] for ch in mine][-1] == full["choices"][k]["finish_reason"]
        if chat:
            assert mine[0]["delta"]["role"] == "assistant"
            n_lp = sum(len(ch["logprobs"]["content"]) for ch in mine)
            assert n_lp == len(full["choices"][k]["logprobs"]["content"])
        else:
            assert sum(len(ch["logprobs"]["tokens"]) for ch in mine) == len(full["choices"][k]["logprobs"]["tokens"])
    assert full["choices"][0]["finish_reason"] == "stop" and full["choices"][0]["matched_stop"] == "cde"
    assert full["usage"] == {"prompt_tokens": len(call.items[0].input_ids), "completion_tokens": 8,
                             "total_tokens": len(call.items[0].input_ids) + 8,
                             "prompt_tokens_details": {"cached_tokens": 16}}
    assert all(c["usage"] is None for c in chunks)
    assert reply.usage_chunk(progs)["choices"] == []
