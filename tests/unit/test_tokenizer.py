"""The front's tokenizer against HF transformers on the same files: chat template rendering,
encoding and decoding; and incremental detokenization against a full decode."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.errors import BadRequest
from pdserve.server.tokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, ServerTokenizer
from tests.harness.fake_worker import CORPUS, write_fake_model

transformers = pytest.importorskip("transformers")

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

# block tags on their own lines (trim_blocks/lstrip_blocks), loop controls, tojson, {% generation %}
TOOLS_TEMPLATE = """{%- for message in messages %}
  {%- if message.role == 'tool' %}{% continue %}{% endif %}
    {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}{% endgeneration %}<|im_end|>
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
{%- endfor %}
{%- if tools %}Tools: {{ tools | tojson(indent=2) }}{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 你好 🙂"},
     {"role": "assistant", "content": "Gut, danke."}, {"role": "user", "content": "Und dir?"}],
    [{"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": "ok"},
     {"role": "tool", "content": "ignored"}, {"role": "user", "content": "naïve café"}],
]
TEXTS = ["Hello world", "héllo wörld, naïve café", "日本語のテキスト 你好，世界", "emoji 🙂🚀✨🎉 ok",
         "한국어 텍스트 and ünïcödé", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
         "<|im_start|>user\nhi<|im_end|>", "numbers 0123456789 ∑∫√"]


def build_metaspace_tokenizer():
    """A Llama-2-style tokenizer: '▁' spaces, byte fallback, BOS added, decoder strips one space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    ordered = sorted(vocab, key=vocab.get)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    new = ordered[:3] + byte_tokens + [t for t in ordered[3:] if t not in byte_tokens]
    data["model"]["vocab"] = {t: i for i, t in enumerate(new)}
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def write_metaspace_model(path: str, template: str) -> None:
    os.makedirs(path, exist_ok=True)
    build_metaspace_tokenizer().save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "chat_template": template, "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours, transformers') for a byte-level ChatML model and a Llama-2-style model."""
    root = tmp_path_factory.mktemp("tok")
    bl, ms = str(root / "bytelevel"), str(root / "metaspace")
    write_fake_model(bl)
    write_metaspace_model(ms, LLAMA2_TEMPLATE)
    hf = transformers.AutoTokenizer
    return {"bytelevel": (ServerTokenizer.from_dir(bl), hf.from_pretrained(bl)),
            "metaspace": (ServerTokenizer.from_dir(ms), hf.from_pretrained(ms))}


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(models, kind, text):
    ours, ref = models[kind]
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.vocab_size == len(ref)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chatml_template_matches_transformers(models, conv, add_generation_prompt):
    ours, ref = models["bytelevel"]
    msgs = CONVERSATIONS[conv]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(msgs, add_generation_prompt) == text
    assert ours.encode_chat(msgs, add_generation_prompt) == ref.encode(text, add_special_tokens=False)


def test_llama2_template_with_bos_and_raise_exception(models):
    ours, ref = models["metaspace"]
    msgs = CONVERSATIONS[1]
    text = ref.apply_chat_template(msgs, tokenize=False)
    assert text.startswith("<s>[INST] <<SYS>>")
    assert ours.apply_chat_template(msgs) == text
    assert ours.encode_chat(msgs) == ref.encode(text, add_special_tokens=False)
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(Exception, match="alternate"):
        ref.apply_chat_template(bad, tokenize=False)
    with pytest.raises(BadRequest, match="alternate"):
        ours.apply_chat_template(bad)


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f", "parameters": {}}}]])
def test_whitespace_loopcontrols_tojson_generation_tag(tmp_path, tools):
    write_fake_model(str(tmp_path))
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    ours, ref = ServerTokenizer.from_dir(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = CONVERSATIONS[2]
    expected = ref.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "ignored" not in expected
    assert ours.apply_chat_template(msgs, True, tools) == expected


def test_no_template_is_bad_request(tmp_path):
    write_fake_model(str(tmp_path))
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(BadRequest, match="no chat template"):
        ServerTokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def incremental(tok, ids, context=None) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tok, context)
    deltas = [d.add(t) for t in ids] + [d.flush()]
    return "".join(deltas), deltas


def expected_text(tok, ids, context=None) -> str:
    ctx = list(context or [])[-CONTEXT_TOKENS:]
    return tok.decode(ctx + ids)[len(tok.decode(ctx)):]


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_equals_full_decode(models, kind, text):
    ours, _ = models[kind]
    ids = ours.encode(text, add_special_tokens=False)
    out, deltas = incremental(ours, ids)
    assert out == ours.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # never shows half a character
    prompt = ours.encode("A prompt: 你好")
    out, _ = incremental(ours, ids, prompt)
    assert out == expected_text(ours, ids, prompt)
    if kind == "bytelevel":
        assert out == ours.decode(ids)


def test_multibyte_characters_are_held_until_complete(models):
    ours, _ = models["bytelevel"]
    ids = ours.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split across byte tokens
    d = IncrementalDetokenizer(ours)
    assert [d.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "🙂"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 399), min_size=1, max_size=40))
def test_incremental_detokenization_random_ids(models, ids):
    ours, _ = models["bytelevel"]
    out, _ = incremental(ours, ids)
    assert out == ours.decode(ids)
