"""Structured outputs in-process: the bitmask on a tiny vocabulary, the engine constrained by a
regex / choice / JSON schema on a tiny random-weight model (greedy and sampled), the PD split
(first token sampled by one run, continued from it by add_prefilled) equal to one run, and the
API fields of every route -> one checked GrammarSpec or a 400 naming the field."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from pdserve.core.errors import BadRequest
from pdserve.core.grammar_spec import GrammarKind, choice_spec, json_schema_spec, regex_spec
from pdserve.core.sampling import SamplingParams
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.grammar_mask import BatchMasks, unpack
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.loader import load_model
from pdserve.engine.sampler import TokenHistory, make_generator, sample
from pdserve.engine.sequence import EngineRequest
from pdserve.grammar.matcher import Matchers
from pdserve.server.openai_protocol import parse_chat, parse_completion
from pdserve.server.protocol import parse_generate
from pdserve.server.structured_outputs import with_grammar
from pdserve.server.tokenizer import ServerTokenizer
from tests.harness.fake_worker import write_fake_model
from tests.harness.tiny_model import make_tiny_model

EOS = 2
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
          "required": ["n", "s"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("so_tiny")))
    model, cfg = load_model(path, torch.float32, "cpu")
    tok = ServerTokenizer.from_dir(path)
    matchers = Matchers(os.path.join(path, "tokenizer.json"), cfg.vocab_size, (EOS,))
    return model, cfg, tok, matchers


def make_engine(tiny, num_pages: int = 256) -> Engine:
    model, cfg, _, matchers = tiny
    pool = KVPool(cfg.num_layers, num_pages, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    ecfg = EngineConfig(num_pages=num_pages, page_size=4, eos_token_ids=(EOS,), vocab_size=cfg.vocab_size)
    return Engine(model, pool, ecfg, grammars=matchers)


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, tuple[list[int], dict]]:
    for r in reqs:
        engine.add(r)
    toks: dict[str, list[int]] = {r.rid: [] for r in reqs}
    done: dict[str, dict] = {}
    for _ in range(2000):
        if not engine.has_work():
            break
        for o in engine.step():
            if o.token_id is not None:
                toks[o.rid].append(o.token_id)
            if o.finished:
                done[o.rid] = o.finish_reason
    assert set(done) == set(toks)
    return {rid: (toks[rid], done[rid]) for rid in toks}


def idle(engine: Engine) -> None:
    s = engine.stats()
    assert s.free_pages + s.cached_pages == s.total_pages and s.running == s.waiting == s.held_pages == 0


# ---- the mask ----------------------------------------------------------------------------

def test_unpack_bit_order():
    words = torch.tensor([[0b101, -1 << 31]], dtype=torch.int32)  # ids 0, 2 and 63
    allowed = unpack(words, 64)[0]
    assert allowed.nonzero().view(-1).tolist() == [0, 2, 63]
    assert unpack(words, 40).shape == (1, 40)  # cut to the logits' width


def test_mask_on_tiny_vocab(tmp_path):
    write_fake_model(str(tmp_path))
    tok = ServerTokenizer.from_dir(str(tmp_path))
    vocab = tok.vocab_size
    m = Matchers(str(tmp_path / "tokenizer.json"), vocab, (EOS,))
    seq = m.new(choice_spec(["ab", "cd"]))
    masks = BatchMasks.fill(m, [None, seq])
    assert masks.rows == [1]
    allowed = unpack(masks.bitmask, vocab)[0]
    texts = {t: tok.token_text(t) for t in allowed.nonzero().view(-1).tolist()}
    assert texts and all(("ab".startswith(s) or "cd".startswith(s)) and s for s in texts.values()), texts
    assert not allowed[EOS]  # nothing is finished yet
    # a token outside the grammar is refused, and the matcher says why
    bad = m.new(regex_spec("[0-9]+"))
    assert not bad.consume(tok.encode("x", add_special_tokens=False)[0]) and bad.error
    # logits: disallowed -> -inf, allowed untouched, rows not under a grammar untouched
    x = torch.randn(2, vocab)
    before = x.clone()
    masks.apply(x, [0, 1])
    assert torch.equal(x[0], before[0])
    assert torch.equal(x[1][allowed], before[1][allowed]) and torch.isinf(x[1][~allowed]).all()


def test_eos_only_where_the_grammar_ends(tiny):
    _, cfg, tok, m = tiny
    seq = m.new(regex_spec("a+"))
    assert seq.consume(tok.encode("a", add_special_tokens=False)[0])
    allowed = unpack(BatchMasks.fill(m, [seq]).bitmask, cfg.vocab_size)[0]
    assert allowed[EOS]  # "a" matches, so it may end here, or go on with more "a"s
    assert not seq.stopped
    choice = m.new(choice_spec(["a"]))
    assert choice.consume(tok.encode("a", add_special_tokens=False)[0]) and choice.stopped


def test_sampled_rows_pick_allowed_tokens_only(tiny):
    _, cfg, tok, m = tiny
    seqs = [m.new(regex_spec("[0-9]+")) for _ in range(4)]
    masks = BatchMasks.fill(m, seqs)
    allowed = unpack(masks.bitmask, cfg.vocab_size)
    logits = torch.randn(4, cfg.vocab_size) * 5
    p = SamplingParams(temperature=1.5, top_k=50, grammar=regex_spec("[0-9]+"))
    for seed in range(20):
        hist = [TokenHistory.for_params([], p) for _ in range(4)]
        out = sample(logits, [p] * 4, [make_generator(seed + k) for k in range(4)], hist, (EOS,), masks)
        assert all(allowed[i, t] for i, t in enumerate(out.tolist()))


# ---- the engine ------------------------------------------------------------------------

def test_engine_outputs_match_their_grammar(tiny):
    _, _, tok, _ = tiny
    eng = make_engine(tiny)
    prompt = tok.encode("hello there")
    greedy = SamplingParams(max_new_tokens=48, temperature=0.0)
    reqs = [EngineRequest("re", prompt, greedy.replace(grammar=regex_spec("[a-c]{3}-[0-9]{2,4}"))),
            EngineRequest("ch", prompt, greedy.replace(grammar=choice_spec(["yes", "no", "maybe"]))),
            EngineRequest("js", prompt, greedy.replace(max_new_tokens=200, grammar=json_schema_spec(SCHEMA))),
            EngineRequest("free", prompt, greedy.replace(max_new_tokens=8)),
            EngineRequest("hot", prompt, SamplingParams(max_new_tokens=48, temperature=1.0, seed=3,
                                                        grammar=regex_spec("(x|y){2,5}z")))]
    out = run(eng, reqs)
    text = {rid: tok.decode(t) for rid, (t, _) in out.items()}
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", text["re"]), text
    assert text["ch"] in ("yes", "no", "maybe")
    assert re.fullmatch(r"(x|y){2,5}z", text["hot"]), text
    for rid in ("re", "ch", "hot"):  # complete: finished as a stop, without waiting for EOS
        assert out[rid][1]["type"] == "stop", out[rid]
    obj = json.loads(text["js"])
    assert set(obj) == {"n", "s"} and isinstance(obj["n"], int) and len(obj["s"]) <= 6
    # the unconstrained row of the same batch is what it is alone
    assert out["free"][0] == run(make_engine(tiny), [reqs[3]])["free"][0]
    idle(eng)


def test_prefilled_continuation_equals_one_run(tiny):
    """The PD split on one engine: a hold_kv run samples the first token under the grammar,
    add_prefilled continues from it over the same pages (a decode's matcher is built from the
    spec and advanced by that token)."""
    _, _, tok, _ = tiny
    prompt = tok.encode("tell me a number")
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, grammar=regex_spec("[a-z]{2,6}=[0-9]{1,5};"))
    whole = run(make_engine(tiny), [EngineRequest("r", prompt, sp)])["r"]
    eng = make_engine(tiny)
    first = run(eng, [EngineRequest("r", prompt, sp.replace(max_new_tokens=1), hold_kv=True)])["r"][0]
    assert first == whole[0][:1]
    outs = [eng.add_prefilled(EngineRequest("r", prompt, sp), first[0])]
    while eng.has_work():
        outs.extend(eng.step())
    assert [o.token_id for o in outs] == whole[0] and outs[-1].finish_reason == whole[1]
    idle(eng)


def test_engine_refuses_what_it_cannot_build(tiny):
    model, cfg, _, _ = tiny
    pool = KVPool(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    bare = Engine(model, pool, EngineConfig(num_pages=16, page_size=4, vocab_size=cfg.vocab_size))
    with pytest.raises(BadRequest, match="tokenizer.json"):
        bare.validate(EngineRequest("x", [5, 6], SamplingParams(max_new_tokens=4, grammar=regex_spec("a"))))
    with pytest.raises(BadRequest, match="min_new_tokens together with regex"):
        make_engine(tiny).validate(EngineRequest("x", [5, 6], SamplingParams(
            max_new_tokens=4, min_new_tokens=2, grammar=regex_spec("a+"))))


# ---- the API fields --------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra, kind", [
    ({"response_format": {"type": "json_object"}}, GrammarKind.JSON_OBJECT),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GrammarKind.JSON_SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarKind.JSON_SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+"}}, GrammarKind.REGEX),
    ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarKind.CHOICE),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, GrammarKind.GRAMMAR),
    ({"structured_outputs": {"json_object": True}}, GrammarKind.JSON_OBJECT),
    ({"guided_json": json.dumps(SCHEMA)}, GrammarKind.JSON_SCHEMA),
    ({"guided_regex": "a+"}, GrammarKind.REGEX),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "guidance"}, GrammarKind.CHOICE),
    ({"guided_grammar": 'start: "a"+'}, GrammarKind.GRAMMAR),
    ({"regex": "a+"}, GrammarKind.REGEX),
    ({"ebnf": 'root ::= "a"'}, GrammarKind.GRAMMAR),
    ({"json_schema": json.dumps(SCHEMA)}, GrammarKind.JSON_SCHEMA),
])
def test_openai_fields_make_a_grammar(tiny, extra, kind):
    tok = tiny[2]
    for call in (parse_chat({"messages": MSGS, **extra}, tok), parse_completion({"prompt": "hi", **extra}, tok)):
        assert {it.sampling.grammar.kind for it in call.items} == {kind}


def test_text_format_and_native_fields(tiny):
    tok = tiny[2]
    assert parse_chat({"messages": MSGS, "response_format": {"type": "text"}}, tok).items[0].sampling.grammar is None
    call = parse_generate({"text": "hi", "sampling_params": {"json_schema": json.dumps(SCHEMA)}}, tok)
    assert call.items[0].sampling.grammar.kind is GrammarKind.JSON_SCHEMA
    call = parse_generate({"text": ["a", "b"], "sampling_params": [{"regex": "x+"}, {"ebnf": 'root ::= "y"'}]}, tok)
    assert [it.sampling.grammar.kind for it in call.items] == [GrammarKind.REGEX, GrammarKind.GRAMMAR]


@pytest.mark.parametrize("extra, msg", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "intger"}}}},
     "(?s)response_format.json_schema.schema is invalid: .*intger"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "yaml"}}, "unknown"),
    ({"response_format": {"type": "structural_tag"}}, "structural_tag.*not supported"),
    ({"guided_regex": "a(b"}, "(?s)guided_regex is invalid: .*unclosed group"),
    ({"guided_grammar": 'root ::= "a" | nothere'}, "guided_grammar is invalid"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "only one"),
    ({"structured_outputs": {}}, "names no constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag is not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern is not supported"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"structural_tag": "{}"}, "structural_tag is not supported"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens .* together with guided_regex is not supported"),
])
def test_openai_bad_constraints_are_400(tiny, extra, msg):
    with pytest.raises(BadRequest, match=msg):
        parse_chat({"messages": MSGS, **extra}, tiny[2])


@pytest.mark.parametrize("sp, msg", [
    ({"json_schema": "{\"type\": \"objekt\"}"}, "sampling_params.json_schema is invalid"),
    ({"regex": "(", "max_new_tokens": 3}, "sampling_params.regex is invalid"),
    ({"ebnf": "root ::= nowhere"}, "sampling_params.ebnf is invalid"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one"),
    ({"structural_tag": "{}"}, "sampling_params.structural_tag is not supported"),
    ({"regex": "a+", "min_new_tokens": 2}, "together with sampling_params.regex is not supported"),
])
def test_native_bad_constraints_are_400(tiny, sp, msg):
    with pytest.raises(BadRequest, match=msg):
        parse_generate({"text": "hi", "sampling_params": sp}, tiny[2])


def test_with_grammar_for_server_code():
    """What tool_choice code calls: a schema dict -> a checked constraint, one per request."""
    sp = with_grammar(SamplingParams(), json_schema_spec({"type": "object"}, "tool_choice"))
    assert sp.grammar.kind is GrammarKind.JSON_SCHEMA and sp.processes_logits
    with pytest.raises(BadRequest, match="only one"):
        with_grammar(sp, regex_spec("a"))
    with pytest.raises(BadRequest, match="tool_choice is invalid"):
        with_grammar(SamplingParams(), json_schema_spec({"type": 3}, "tool_choice"))
