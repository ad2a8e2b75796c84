"""SentencePiece BPE vocabularies in GGUF files (`tokenizer.ggml.model = llama`: Llama 2,
Mistral, Mixtral, Gemma) -> an equivalent `tokenizers.Tokenizer`.

SentencePiece BPE merges the adjacent pair whose merged piece scores highest; a BPE model
whose merges are ranked by that score does the same. Spaces become "▁", a "▁" is prepended
to each text run unless the file says `add_space_prefix = false` (Gemma), as llama.cpp does
after every special token too; characters outside the vocabulary fall back to <0xNN> bytes.
Control tokens are special, user-defined ones match whole, as in SentencePiece.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPACE = "\u2581"
# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of vocabulary pieces that forms a normal piece, ranked by that
    piece's score (highest first), ties by the halves' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] not in (NORMAL, 0):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None,
                        add_space_prefix: bool) -> Tokenizer:
    """The tokenizer without a post-processor (BOS/EOS are added by the caller)."""
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF SentencePiece vocabulary has {len(tokens)} tokens but {len(scores)} scores")
    types = list(types) or [NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tail = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok
