"""Per-sequence grammar matchers over one model's vocabulary, and the batched bitmask fill.

A mask row is (vocab_words) int32 words, bit t of word t // 32 set when token t may come next;
EOS is allowed exactly where the grammar may end. `Matchers` builds llguidance's tokenizer view
once, on the first grammar request (about a second for a 50k vocabulary), so workers that never
see one pay nothing.
"""

from __future__ import annotations

import functools

import llguidance
import tokenizers

from ..core.errors import BadRequest
from ..core.grammar_spec import GrammarSpec
from .compiler import compile_spec


class SeqMatcher:
    """One sequence's position in its grammar, advanced by every token it emits."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.m = matcher

    def consume(self, token: int) -> bool:
        """Advance by `token`; False when the grammar does not allow it (the matcher is then dead)."""
        return self.m.consume_token(token)

    @property
    def stopped(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()


class Matchers:
    """Matchers for one vocabulary: `new(spec)` per sequence, `fill` for a batch of them."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int = 2):
        self.tokenizer_json = tokenizer_json  # path of the model's tokenizer.json
        self.model_vocab = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.threads = max(1, threads)
        self._tok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tok is None:
            with open(self.tokenizer_json, encoding="utf-8") as f:
                text = f.read()
            n = tokenizers.Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
            eos = list(self.eos_token_ids) or None
            self._tok = llguidance.LLTokenizer(text, n_vocab=max(self.model_vocab, n), eos_token=eos)
            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        return self._tok

    @property
    def vocab_words(self) -> int:
        """int32 words per mask row (covers the model's logits and every tokenizer id)."""
        return (self.tokenizer.vocab_size + 31) // 32

    def new(self, spec: GrammarSpec) -> SeqMatcher:
        """A fresh matcher at the grammar's start; a grammar llguidance rejects -> 400."""
        return SeqMatcher(self._template(compile_spec(spec)).deep_copy())

    @functools.lru_cache(maxsize=128)  # noqa: B019 (one Matchers per engine, kept for its life)
    def _template(self, grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise BadRequest(f"grammar is invalid: {m.get_error()}")
        return m

    def fill(self, matchers: list[SeqMatcher], ptr: int, rows: int) -> None:
        """Write matchers[i]'s next-token mask into row i of the int32 [rows, vocab_words] array
        at `ptr` (C order), in parallel on the executor's threads."""
        assert len(matchers) <= rows
        _ = self.tokenizer  # builds the executor too
        row_bytes = 4 * self.vocab_words
        self._executor.unsafe_compute_mask_ptr([(s.m, i) for i, s in enumerate(matchers)], ptr, row_bytes, rows)
