"""Rebuild an HF `tokenizer.json` + `tokenizer_config.json` from a GGUF's tokenizer metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) and SentencePiece BPE ones
(`llama`, see gguf_spm.py) are supported. For byte-level BPE the text split before BPE follows
llama.cpp's `tokenizer.ggml.pre` type, so token ids match what the model was trained on (e.g.
`smollm` splits every numeric character apart, as SmolLM2's own tokenizer does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .gguf_spm import build_spm_tokenizer

log = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp pre-tokenizer type -> how text is split before byte-level BPE:
# "gpt2" = the GPT-2 regex, "digits" = every numeric char alone then the GPT-2 regex,
# otherwise a regex applied before a regex-free byte-level step.
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "default": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits",
    "codeshell": "digits", "exaone": "digits", "minerva": "digits",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass(frozen=True)
class GGUFTokenizerData:
    """The tokenizer part of a GGUF's metadata, under readable names."""

    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None
    context_length: int
    scores: tuple[float, ...] = ()  # tokenizer.ggml.scores (SentencePiece)
    add_space_prefix: bool = True  # tokenizer.ggml.add_space_prefix (SentencePiece)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _spell(token: str, alphabet: set[str]) -> str:
    """A vocab entry in byte-level spelling (a few GGUFs store raw text for some tokens)."""
    if set(token) <= alphabet:
        return token
    table = byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str):
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        log.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 split", pre)
        split = "gpt2"
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's tokenizer."""
    if data.model == "llama":
        tok = build_spm_tokenizer(data.tokens, list(data.scores), data.token_types, data.unk_id,
                                  data.add_space_prefix)
        if data.add_bos and data.bos_id is not None:
            tok.post_processor = _bos_template(data)
        return tok
    if data.model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {data.model!r} is not supported "
                         f"(byte-level BPE 'gpt2' and SentencePiece 'llama' only)")
    alphabet = set(byte_alphabet().values())
    vocab = {_spell(t, alphabet): i for i, t in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(data.pre)
    tok.decoder = decoders.ByteLevel()
    if data.add_bos and data.bos_id is not None:
        tok.post_processor = _bos_template(data)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = data.token_types or [0] * len(data.tokens)
    # control tokens outside the byte alphabet are llama.cpp mislabels; they stay plain vocab
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(data.tokens, types) if ty == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(data.tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


def _bos_template(data: GGUFTokenizerData) -> processors.TemplateProcessing:
    bos = data.tokens[data.bos_id]
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                         special_tokens=[(bos, data.bos_id)])


def tokenizer_config(data: GGUFTokenizerData) -> dict:
    """The tokenizer_config.json HF transformers (and our server) read next to tokenizer.json."""

    def name(i: int | None) -> str | None:
        return data.tokens[i] if i is not None and 0 <= i < len(data.tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(data.bos_id),
        "eos_token": name(data.eos_id),
        "unk_token": name(data.unk_id),
        "pad_token": name(data.pad_id),
        "add_bos_token": data.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": data.context_length,
    }
    if data.chat_template:
        cfg["chat_template"] = data.chat_template
    return cfg
