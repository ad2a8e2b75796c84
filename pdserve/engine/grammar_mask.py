"""Token bitmasks of the grammar-constrained rows of a batch, applied to their logits.

The engine asks each row's matcher (pdserve/grammar) for its next-token bitmask, all rows in one
parallel fill, and the sampler sets every disallowed token's logit to -inf after the logit
processors, so greedy, temperature and top-k/p/min-p all pick among allowed tokens only.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from ..core.errors import BadRequest
from ..grammar.matcher import Matchers, SeqMatcher

assert sys.byteorder == "little", "the bitmask is read as little-endian bytes"


@dataclass
class BatchMasks:
    rows: list[int]  # batch rows under a grammar
    bitmask: torch.Tensor  # int32 [len(rows), words]

    @classmethod
    def fill(cls, matchers: Matchers, row_matchers: list[SeqMatcher | None]) -> "BatchMasks | None":
        rows = [i for i, m in enumerate(row_matchers) if m is not None]
        if not rows:
            return None
        bitmask = torch.zeros((len(rows), matchers.vocab_words), dtype=torch.int32)
        matchers.fill([row_matchers[i] for i in rows], bitmask.data_ptr(), len(rows))
        return cls(rows, bitmask)

    def apply(self, x: torch.Tensor, x_rows: list[int]) -> None:
        """x: float logits [len(x_rows), V] of batch rows x_rows (a superset of self.rows);
        disallowed tokens -> -inf, in place. Done as an add of 0 / -inf: a vectorized add is
        several times faster than masked_fill on a scattered mask."""
        bias = _bias(self.bitmask.to(x.device), x.shape[1], x.dtype)
        if x_rows == self.rows:  # every processed row is constrained
            x.add_(bias)
            return
        at = {r: j for j, r in enumerate(x_rows)}
        x.index_add_(0, torch.tensor([at[r] for r in self.rows], device=x.device), bias)


@functools.lru_cache(maxsize=8)
def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: row b holds 0 where bit j of byte b is set (allowed), -inf where not."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits.eq(0), float("-inf")).to(device)


def _bias(bitmask: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """int32 [R, W] bitmask -> [R, vocab] of 0 (allowed) / -inf. Bit t of word t // 32 is token t;
    read byte by byte (little-endian) through a 256 x 8 table, one gather instead of shifting
    every word 32 times."""
    b = bitmask.contiguous().view(torch.uint8).view(-1).int()
    return _byte_bias(dtype, bitmask.device).index_select(0, b).view(bitmask.shape[0], -1)[:, :vocab]


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [R, W] bitmask -> bool [R, vocab] (True: allowed)."""
    return _bias(bitmask, vocab, torch.float32).eq(0)


class EngineGrammar:
    """The engine's side of structured outputs: a matcher per constrained sequence, built when
    the sequence is, and advanced by each token it emits (a prefilled sequence's first token
    too, so a decode continues where the prefill's sampling left the grammar)."""

    def __init__(self, matchers: Matchers | None):
        self.matchers = matchers  # None: this engine has no tokenizer view, grammars are refused

    def check(self, rid: str, sampling) -> None:
        spec = sampling.grammar
        if spec is None:
            return
        if self.matchers is None:
            raise BadRequest(f"request {rid}: {spec.describe()} needs the model's tokenizer.json, "
                             f"which this server's model directory lacks")
        if sampling.min_new_tokens:  # the front refuses it too (server/structured_outputs.py)
            raise BadRequest(f"request {rid}: min_new_tokens together with {spec.describe()} is not "
                             f"supported by this server")
        self.matchers.new(spec)  # compiles (cached): a grammar the library rejects is a 400 here

    def attach(self, seq) -> None:
        spec = seq.req.sampling.grammar
        if spec is not None:
            seq.matcher = self.matchers.new(spec)

    def masks(self, seqs) -> BatchMasks | None:
        if self.matchers is None:
            return None
        return BatchMasks.fill(self.matchers, [s.matcher for s in seqs])

    @staticmethod
    def refused(seq, token: int) -> dict | None:
        """Advance seq's matcher by `token`; the finish reason when the grammar refuses it."""
        m = seq.matcher
        if m is None or m.consume(token):
            return None
        return {"type": "abort", "message": f"request {seq.rid}: token {token} does not fit its "
                f"{seq.req.sampling.grammar.describe()} ({m.error or 'refused'})"}

    @staticmethod
    def complete(seq) -> bool:
        """The grammar allows nothing more: the output is finished."""
        return seq.matcher is not None and seq.matcher.stopped
