"""How far bfloat16 rounding alone can move a model's logits: a float64 model whose every op
result is rounded to a bf16 neighbour chosen at random (random rounding, as in the CESTAC
method / discrete stochastic arithmetic of Vignes, CADNA).

A correct bf16 implementation computes each op's result from its bf16 inputs and rounds it to
bf16 once (a matmul accumulates in float32 first, whose rounding is 2^16 times finer than
bf16's): each op result is one of the two bf16 numbers around the exact value, which one
depending on the kernel (summation order, fused or not, AMX, AVX2, CUDA). `RandomBf16Rounding`
makes that choice at random for every element of every op, so runs under it sample the
implementations that round each op faithfully; their spread around the float64 result is the
error bf16 arithmetic can explain for this model, these weights and these tokens, the same on
any machine (a seeded torch.Generator draws the choices). CPU tensors only.

Random up/down rounding errs by up to one bf16 step (std 0.58 step) where round-to-nearest errs
by at most half a step (std 0.29): the spread measured this way is about twice that of a
round-to-nearest kernel, a margin that a check built on it keeps.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

DROP = 52 - 7  # float64 keeps 52 fraction bits, bfloat16 7
LOW = (1 << DROP) - 1
HIGH = ~LOW
POOL = 1 << 20  # random choices drawn at a time
aten = torch.ops.aten
# ops that only move or repeat their inputs' values: nothing new to round where those are float64
MOVES = {aten._unsafe_view.default, aten.clone.default, aten.cat.default, aten.stack.default,
         aten.embedding.default, aten.index_select.default, aten.index.Tensor}


def round_either_way(x: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """x (float64) rounded per element to one of its two neighbours with bf16's 8 significant
    bits: toward zero where `carry` (int64, x's shape) is 0, away from zero where it is LOW;
    numbers with 8 bits already (and infinities) are kept either way. float64 is
    sign-magnitude: clearing the low bits goes toward zero, carrying into them first goes away
    from it (to the same number where they are 0). (float64's exponent range is wider than
    bf16's: a model whose values stay within 1e-38..3e38 does not see the difference.)"""
    return ((x.view(torch.int64) + carry) & HIGH).view(torch.float64)


class RandomBf16Rounding(TorchDispatchMode):
    """Under this mode every aten op that yields a float64 tensor has it rounded to bf16 by
    `round_either_way`, each element up or down with probability 1/2 (a seeded generator): a
    float64 model then computes as a bf16 one does (float32 steps, such as HF's norms and
    softmax, stay float32 as they do in bf16), with a random faithful rounding at each op.
    In-place ops round the tensor they wrote; views and `MOVES` of float64 inputs pass (their
    values are rounded ones already)."""

    def __init__(self, seed: int):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)
        self.pool, self.used = torch.empty(0, dtype=torch.int64), 0
        self.kinds: dict = {}

    def _carry(self, shape: torch.Size) -> torch.Tensor:
        """The next shape.numel() of a stream of random 0/LOW: 31 per int32 drawn (random_ on
        int32 draws 0..2^31-1), as one draw per op would cost more than the op."""
        n = shape.numel()
        if self.used + n > self.pool.numel():
            words = torch.empty(max(POOL, n) // 31 + 1, dtype=torch.int32).random_(generator=self.gen)
            bits = (words.unsqueeze(1) >> torch.arange(31, dtype=torch.int32)) & 1
            self.pool = bits.view(-1).long() * LOW
            self.used = 0
        self.used += n
        return self.pool[self.used - n:self.used].view(shape)

    def _round(self, t):
        if isinstance(t, torch.Tensor) and t.dtype is torch.float64:
            return round_either_way(t, self._carry(t.shape))
        return t

    def _kind(self, func) -> str:
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = ("view" if func.is_view else "move" if func in MOVES
                                       else "in_place" if func._schema.is_mutable else "new")
        return kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = self._kind(func)
        if kind == "view" or (kind == "move" and all(
                t.dtype is torch.float64 for t in tree_leaves(args) if isinstance(t, torch.Tensor)
                and t.is_floating_point())):
            return out
        if kind == "in_place":
            def in_place(t):
                if isinstance(t, torch.Tensor) and t.dtype is torch.float64:
                    t.copy_(self._round(t))
                return t
            return tree_map(in_place, out)
        return self._round(out) if isinstance(out, torch.Tensor) else tree_map(self._round, out)
