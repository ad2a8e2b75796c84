"""SentencePiece BPE vocabularies as llama.cpp writes them into GGUF (pieces, scores, token
types; `add_space_prefix`): the tokenizer we rebuild must give SentencePiece's own ids, with
byte fallback for characters outside the vocabulary, and decode back to the text."""

from __future__ import annotations

import io
import random

import gguf
import pytest

spm = pytest.importorskip("sentencepiece")

from pdserve.model_files.gguf_convert import GGUFMetadata, tokenizer_data  # noqa: E402
from pdserve.model_files.gguf_tokenizer import build_tokenizer  # noqa: E402

_RNG = random.Random(0)
# words over a small alphabet, so that merges overlap and their order decides the pieces
CORPUS = [" ".join("".join(_RNG.choice("abcde") for _ in range(_RNG.randint(2, 9))) for _ in range(12))
          + f" {i * 37}." for i in range(400)]
TEXTS = ["abcab deabc aabbccdd", "  two  spaces and\ta tab", "ebad cabbed 1234567!",
         "unseen: é, 中文, emoji 🦊", "dab cab <tool> ebb", ""]


def _trained(add_dummy_prefix: bool):
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=320, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<tool>"], character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
        minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def _gguf_vocab(sp) -> tuple[list[str], list[float], list[int]]:
    """The vocabulary as llama.cpp's converter writes it (gguf.TokenType per piece)."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                     else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                     else gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) == "<tool>" else gguf.TokenType.NORMAL)
    return tokens, scores, types


@pytest.mark.parametrize("prefix", [True, False])  # Llama/Mistral: True, Gemma: False
def test_spm_gguf_tokenizer_matches_sentencepiece(tmp_path, prefix):
    sp = _trained(prefix)
    tokens, scores, types = _gguf_vocab(sp)
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = tokenizer_data(GGUFMetadata(gguf.GGUFReader(path), path), "llama")
    assert data.add_bos  # llama.cpp's default for SentencePiece files
    tok = build_tokenizer(data)
    for text in TEXTS[:-2]:
        ids = tok.encode(text).ids
        assert ids == [1] + sp.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == text, text
    assert any(tokens[i].startswith("<0x") for i in tok.encode(TEXTS[3]).ids)  # byte fallback used
    assert tok.encode("").ids == [1]
    # a user-defined piece is one token; the text after it gets a fresh space prefix, as in llama.cpp
    left, right = TEXTS[-2].split("<tool>")
    want = sp.encode(left) + [tokens.index("<tool>")] + sp.encode(right)
    assert tok.encode(TEXTS[-2]).ids == [1] + want
    if not prefix:  # no prefix to add: SentencePiece's own ids for the whole text
        assert want == sp.encode(TEXTS[-2])
