"""skip_special_tokens, spaces_between_special_tokens, SGLang's no_stop_trim and vLLM's
include_stop_str_in_output: parsed on each route where its project takes it, and the text they
give (whole and streamed) against HF transformers' decode of the same ids, in-process."""

from __future__ import annotations

import pytest

from pdserve.core.errors import BadRequest
from pdserve.core.messages import TokenOutput
from pdserve.core.sampling import SamplingParams
from pdserve.server.openai_api import OpenAIReply
from pdserve.server.openai_protocol import parse_chat, parse_completion
from pdserve.server.protocol import RequestItem, item_reply, parse_generate
from pdserve.server.request_state import ItemProgress
from pdserve.server.text_options import StopInText, TextOptions
from pdserve.server.tokenizer import ServerTokenizer
from tests.harness.fake_worker import write_fake_model

transformers = pytest.importorskip("transformers")

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> tuple[ServerTokenizer, object]:
    """(ours, transformers') for the byte-level ChatML test model (ids 0..2 are special)."""
    d = str(tmp_path_factory.mktemp("model"))
    write_fake_model(d)
    return ServerTokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)


# ---- parsing -------------------------------------------------------------------------------
def test_defaults_and_sglang_router_bodies(toks):
    tok, _ = toks
    assert parse_generate({"text": "a"}, tok).items[0].text == TextOptions()
    chat = {"messages": CHAT, "no_stop_trim": False, "skip_special_tokens": True}  # sglang-router 0.3.2 sends
    assert parse_chat(chat, tok).items[0].text == TextOptions(True, StopInText.TRIM)


def test_generate_reads_sampling_params_per_prompt(toks):
    tok, _ = toks
    call = parse_generate({"text": ["a", "b"], "sampling_params": [
        {"skip_special_tokens": False, "no_stop_trim": True, "n": 2},
        {"spaces_between_special_tokens": False, "n": 2}]}, tok)
    assert [it.text for it in call.items] == [TextOptions(False, StopInText.WHOLE_TOKEN)] * 2 + [TextOptions()] * 2
    # vLLM's name is not SGLang's: /generate ignores it like any unknown key
    one = parse_generate({"text": "a", "sampling_params": {"include_stop_str_in_output": True}}, tok)
    assert one.items[0].text == TextOptions()


@pytest.mark.parametrize("parse,base", [(parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "a"})])
def test_openai_routes_read_top_level_fields(toks, parse, base):
    tok, _ = toks
    def text(**kw):
        return parse({**base, **kw}, tok).items[0].text
    assert text(skip_special_tokens=False) == TextOptions(False)
    assert text(include_stop_str_in_output=True).stop_in_text is StopInText.THROUGH_STOP
    assert text(no_stop_trim=True).stop_in_text is StopInText.WHOLE_TOKEN
    assert text(no_stop_trim=True, include_stop_str_in_output=True).stop_in_text is StopInText.WHOLE_TOKEN
    assert text(no_stop_trim=False, include_stop_str_in_output=True).stop_in_text is StopInText.THROUGH_STOP
    assert text(spaces_between_special_tokens=False) == TextOptions()


@pytest.mark.parametrize("field", ["skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                                   "include_stop_str_in_output"])
def test_non_boolean_values_are_400s_naming_the_field(toks, field):
    tok, _ = toks
    with pytest.raises(BadRequest, match=f"^{field} must be a boolean"):
        parse_completion({"prompt": "a", field: "yes"}, tok)
    if field != "include_stop_str_in_output":
        with pytest.raises(BadRequest, match=f"sampling_params.{field} must be a boolean"):
            parse_generate({"text": "a", "sampling_params": {field: 1}}, tok)


# ---- special tokens: the text against transformers ------------------------------------------
def _item(opts: TextOptions, prompt: list[int], stop=(), return_logprob=False) -> RequestItem:
    return RequestItem(0, "r", prompt, SamplingParams(stop=tuple(stop)), True, return_logprob, text=opts)


def _run(tok, item: RequestItem, ids: list[int], reason: dict | None = None) -> tuple[ItemProgress, list[str]]:
    """Feed `ids` one per output; returns the progress and the native stream's text after each."""
    prog, seen = ItemProgress(item, tok), []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        prog.apply(TokenOutput("r", [t], [-0.5], finished=last,
                               finish_reason=(reason or {"type": "length", "length": len(ids)}) if last else None))
        seen.append(item_reply(prog, tok, False)["text"])
    return prog, seen


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_the_text_equal_transformers_decode(toks, skip):
    tok, ref = toks
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = tok.encode("Hello<|im_start|> there<|endoftext|>\n<|im_end|>x", add_special_tokens=False)
    assert {0, 1, 2} <= set(out)  # every special token is in the output
    prog, seen = _run(tok, _item(TextOptions(skip), prompt), out)
    want = ref.decode(out, skip_special_tokens=skip)
    assert prog.text == want == ref.decode(out, skip_special_tokens=skip, spaces_between_special_tokens=False)
    assert ("<|im_start|>" in want) is not skip
    assert all(want.startswith(s) for s in seen) and seen[-1] == want  # the stream only grows, to the whole


def test_logprob_token_texts_keep_special_tokens_either_way(toks):
    tok, _ = toks
    for skip in (True, False):  # as SGLang's return_text_in_logprobs and vLLM's logprobs: not affected
        prog, _ = _run(tok, _item(TextOptions(skip), [5], return_logprob=True), [1, 7])
        texts = [t for _, _, t in item_reply(prog, tok, True)["meta_info"]["output_token_logprobs"]]
        assert texts == ["<|im_start|>", tok.token_text(7)]


# ---- stop strings and stop tokens ------------------------------------------------------------
class PieceTok:
    """id i < 26 decodes to one letter, 26 is a special token "<e>", 27 decodes to "cdX"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 26 and skip_special_tokens else "<e>" if i == 26 else "cdX" if i == 27
                       else chr(ord("a") + i) for i in ids)

    def token_text(self, i):
        return self.decode([i], False)


def letters(s: str) -> list[int]:
    return [ord(c) - ord("a") for c in s]


@pytest.mark.parametrize("mode,want", [(StopInText.TRIM, "ab"), (StopInText.THROUGH_STOP, "abcd"),
                                       (StopInText.WHOLE_TOKEN, "abcdX")])
def test_stop_string_trim_or_keep(mode, want):
    prog, seen = _run(PieceTok(), _item(TextOptions(True, mode), [0], stop=("cd",)), letters("ab") + [27, 5])
    assert prog.finished and prog.finish_reason == {"type": "stop", "matched": "cd"}
    assert prog.text == want and prog.output_ids == letters("ab") + [27]
    assert seen[-2] == want  # the stop matched there: the output after it is ignored


def test_kept_stop_strings_are_not_held_back_while_streaming():
    trim = ItemProgress(_item(TextOptions(), [0], stop=("cde",)), PieceTok())
    keep = ItemProgress(_item(TextOptions(True, StopInText.THROUGH_STOP), [0], stop=("cde",)), PieceTok())
    for prog in (trim, keep):
        prog.apply(TokenOutput("r", letters("abc")))
    assert (trim.visible_text(), keep.visible_text()) == ("ab", "abc")
    assert keep.apply(TokenOutput("r", letters("def")))  # matched: the worker is aborted
    assert keep.text == "abcde"


@pytest.mark.parametrize("mode", list(StopInText))
@pytest.mark.parametrize("skip", [True, False])
def test_matched_stop_token_text(mode, skip):
    tok = PieceTok()
    eos, _ = _run(tok, _item(TextOptions(skip, mode), [0]), [0, 1, 26], {"type": "stop", "matched": 26})
    plain, _ = _run(tok, _item(TextOptions(skip, mode), [0]), [0, 1, 3], {"type": "stop", "matched": 3})
    keep = mode is not StopInText.TRIM
    assert eos.text == ("ab<e>" if keep and not skip else "ab")  # a special stop token still obeys skip
    assert plain.text == ("abd" if keep else "ab")  # a stop_token_ids id's text stays when kept
    assert eos.output_ids == [0, 1, 26] and plain.output_ids == [0, 1, 3]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("field", ["no_stop_trim", "include_stop_str_in_output"])
def test_openai_stream_and_whole_reply_keep_the_stop(toks, chat, field):
    tok = PieceTok()
    body = ({"messages": CHAT} if chat else {"prompt": "a"}) | {"stop": ["cd"], "stream": True, field: True}
    call = (parse_chat if chat else parse_completion)(body, toks[0])
    reply = OpenAIReply(call, tok, "m", chat)  # type: ignore[arg-type]
    prog = ItemProgress(call.items[0], tok)  # type: ignore[arg-type]
    parts = []
    for t in letters("ab") + [27]:
        prog.apply(TokenOutput("r", [t]))
        c = reply.chunk(prog)
        parts.append(c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"])
    want = "abcdX" if field == "no_stop_trim" else "abcd"
    whole = reply.full([prog])["choices"][0]
    assert "".join(parts) == (whole["message"]["content"] if chat else whole["text"]) == want
    assert whole["finish_reason"] == "stop" and whole["matched_stop"] == "cd"


def test_chat_shows_the_eos_with_no_stop_trim_and_special_tokens_kept(toks):
    tok, ref = toks
    body = {"messages": CHAT, "no_stop_trim": True, "skip_special_tokens": False}
    call = parse_chat(body, tok)
    out = tok.encode("Hi there<|im_end|>", add_special_tokens=False)
    prog, _ = _run(tok, call.items[0], out, {"type": "stop", "matched": out[-1]})
    content = OpenAIReply(call, tok, "m", True).full([prog])["choices"][0]["message"]["content"]
    assert content == ref.decode(out, skip_special_tokens=False) and content.endswith("<|im_end|>")
    default, _ = _run(tok, parse_chat({"messages": CHAT}, tok).items[0], out, {"type": "stop", "matched": out[-1]})
    assert default.text == "Hi there"
