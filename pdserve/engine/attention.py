"""Paged attention for a mixed batch of sequences, on any torch device.

The runner builds one `AttnBatch` per step and every layer reuses it. New tokens' K/V are
written to their slots first; then:
- decode (one new token per sequence): every sequence's K/V is gathered by slot, KV head
  major, into a padded [B, Hkv, L] layout and attended in one batched call (`_decode_attention`);
- otherwise (prefill chunks; any mix): one call per sequence. A sequence with no cached
  prefix attends to its own new K/V causally (no gather); one with a prefix gathers its slots
  and uses a causal mask offset by the prefix. Per sequence, nothing is padded.
On CPU in bfloat16/float16 plain batched matmuls beat SDPA's kernel at these sizes (it is
built for long sequences): see `_decode_attention` and `_causal_matmul_attention`.
On CPU in bfloat16 every step goes to our C kernel instead where the engine has one
(`batch.kernel`, see cpu_kernels.py): it attends reading the pool in place, each new token a
query over its own sequence's slots (at 32 sequences ~2.5x faster than gather + bmm for
decode); a long prefill chunk is tiled over query and key blocks (two-pass softmax, ~1.5x
the per-query path per layer at 1k-8k tokens; 2.1-2.5x with online softmax) (docs/benchmarks.md, "Long prompts").
A layer whose `AttnParams` window is shorter than the step's longest sequence, or that
soft-caps its scores, goes to windowed_attention.py instead (explicit masks, HF's eager math).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cpu_kernels import PagedAttentionKernel
from .kv_pool import KVPool

REDUCED_PRECISION = (torch.bfloat16, torch.float16)
GEMM_DECODE_MIN_BATCH = 4  # below this, SDPA's per-call cost is lower than the matmul path's
GEMM_PREFILL_MAX_LEN = 256  # above this, SDPA's flash kernel beats materialized scores


class AttnShape(enum.Enum):
    DECODE = "decode"
    PER_SEQUENCE = "per_sequence"


@dataclass(frozen=True)
class AttnParams:
    """One layer's attention: score scale, sliding window (keys back from the query, itself
    included; None = full) and tanh soft-cap of the scores (None = none)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass
class SeqSpan:
    """One sequence of a PER_SEQUENCE step: its new tokens are flat rows [start, start + new)."""

    start: int
    new: int
    slots: torch.Tensor | None  # [L] slots of its whole KV; None when it has no cached prefix
    mask: torch.Tensor | None  # [new, L] bool causal mask offset by the prefix (with slots)


@dataclass
class AttnBatch:
    shape: AttnShape
    write_slots: torch.Tensor  # [T] slot of each new token, in flat token order
    gather_slots: torch.Tensor | None = None  # [B, L] slots of each sequence, pad 0 (DECODE,
    # and PER_SEQUENCE with a kernel)
    mask: torch.Tensor | None = None  # DECODE: [B, L] bool, True = real key; None if all equal
    key_bias: torch.Tensor | None = None  # DECODE: the mask as float32 0 / -inf, [B, 1, 1, L]
    spans: list[SeqSpan] | None = None  # PER_SEQUENCE
    # DECODE: rows of a layer's [num_slots * Hkv, D] K (or V) view in [B, Hkv, L] order; made
    # by the first layer (which knows Hkv) and reused by the others
    head_rows: torch.Tensor | None = None
    kernel: PagedAttentionKernel | None = None  # our CPU kernel, where it was built
    # with a kernel: keys each query (new token) attends to, its own included [T], and for
    # PER_SEQUENCE the row of gather_slots it reads [T] (DECODE: row = query)
    key_counts: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    compute_dtype: torch.dtype | None = None  # torch path: compute in this dtype (None: q's)
    seq_lens: tuple[int, ...] = ()  # KV length of each sequence after this step
    new_lens: tuple[int, ...] = ()  # its new tokens this step
    rope_lens: tuple[int, ...] = ()  # tokens each sequence has (its whole prompt while prefilling)
    masks: dict = field(default_factory=dict)  # windowed_attention's, per window, once a step

    @property
    def max_len(self) -> int:
        return max(self.seq_lens)

    def token_seq_lens(self) -> torch.Tensor:
        """[T] the length of each new token's sequence as HF generation sees it (the whole
        prompt while prefilling, in any chunk), on CPU: what length-dependent RoPE reads."""
        return torch.repeat_interleave(torch.tensor(self.rope_lens or self.seq_lens),
                                       torch.tensor(self.new_lens))

    def use_kernel(self, q: torch.Tensor, k: torch.Tensor, pool_k: torch.Tensor) -> bool:
        return (self.kernel is not None and self.key_counts is not None
                and k.dtype is q.dtype and self.kernel.supports(q, pool_k))

    @staticmethod
    def build(seq_lens: list[int], new_lens: list[int], page_rows: list[list[int]],
              page_size: int, device: torch.device | str = "cpu",
              kernel: PagedAttentionKernel | None = None,
              rope_lens: list[int] | None = None,
              compute_dtype: torch.dtype | None = None) -> "AttnBatch":
        """seq_lens[i]: KV length of sequence i after this step; new_lens[i]: tokens it adds
        this step (the last new_lens[i] of its seq_lens[i]); page_rows[i]: its pages in order.
        kernel: used where it supports the call (CPU, bfloat16), else the torch path;
        rope_lens: tokens each sequence has (default seq_lens), see token_seq_lens;
        compute_dtype: the torch path computes in it (None: the model's dtype)."""
        B = len(seq_lens)
        L = max(seq_lens)
        max_pages = -(-L // page_size)
        rows = [r[:max_pages] for r in page_rows]
        table = torch.tensor([r + [0] * (max_pages - len(r)) for r in rows], dtype=torch.long)
        slots = (table.unsqueeze(-1) * page_size + torch.arange(page_size)).view(B, -1)[:, :L]
        if max(new_lens) == 1:
            seq = torch.tensor(seq_lens, dtype=torch.long)
            write = slots.gather(1, (seq - 1).view(B, 1)).view(B)
            mask = bias = None
            if min(seq_lens) != L:
                mask = (torch.arange(L).view(1, L) < seq.view(B, 1)).to(device)
                bias = torch.zeros(B, 1, 1, L, device=device).masked_fill_(~mask.view(B, 1, 1, L),
                                                                            float("-inf"))
            return AttnBatch(AttnShape.DECODE, write.to(device),
                             gather_slots=slots.contiguous().to(device), mask=mask, key_bias=bias,
                             kernel=kernel, key_counts=seq.to(device) if kernel else None,
                             seq_lens=tuple(seq_lens), new_lens=tuple(new_lens),
                             rope_lens=tuple(rope_lens or ()), compute_dtype=compute_dtype)
        spans, writes, start = [], [], 0
        for i, (n, new) in enumerate(zip(seq_lens, new_lens)):
            writes.append(slots[i, n - new:n])
            span = SeqSpan(start, new, None, None)
            if new < n:
                kpos = torch.arange(n).view(1, n)
                qpos = torch.arange(n - new, n).view(new, 1)
                span.slots = slots[i, :n].contiguous().to(device)
                span.mask = (kpos <= qpos).to(device)
            spans.append(span)
            start += new
        batch = AttnBatch(AttnShape.PER_SEQUENCE, torch.cat(writes).to(device), spans=spans,
                          seq_lens=tuple(seq_lens), new_lens=tuple(new_lens),
                          rope_lens=tuple(rope_lens or ()), compute_dtype=compute_dtype)
        if kernel is not None:  # (spans stay for the torch path: the kernel may not take q)
            # each new token is a query over its sequence's first (position + 1) slots, read
            # from the pool after all new K/V are stored: causal with or without a prefix
            news = torch.tensor(new_lens)
            rows = torch.repeat_interleave(torch.arange(B), news)
            ends = torch.tensor(seq_lens)[rows]
            last = torch.cumsum(news, 0)[rows]  # one past the flat index of its sequence's last token
            batch.kernel = kernel
            batch.key_counts = (ends - (last - torch.arange(len(rows))) + 1).to(device)
            batch.query_rows = rows.to(device)
            batch.gather_slots = slots.contiguous().to(device)
        return batch


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    batch: AttnBatch, pool: KVPool, params: AttnParams | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, Hq*D].
    params: None = full attention scaled by D ** -0.5."""
    D = q.shape[2]
    scale = None if params is None or params.scale == D ** -0.5 else params.scale
    if params is not None and (params.softcap is not None or (
            params.window is not None and batch.seq_lens and batch.max_len > params.window)):
        from .windowed_attention import windowed_attention

        pool.write(layer, batch.write_slots, k.to(pool.dtype), v.to(pool.dtype))
        return windowed_attention(q, k, v, layer, batch, pool, params)
    if batch.use_kernel(q, k, pool.k(layer)):
        kw = {} if scale is None else {"scale": scale}  # (the kernel's default: D ** -0.5)
        if batch.shape is AttnShape.DECODE:  # stores k/v and attends in one call
            return batch.kernel(q, k, v, pool.k(layer), pool.v(layer), batch.write_slots,
                                batch.gather_slots, batch.key_counts, **kw)
        pool.write(layer, batch.write_slots, k, v)  # every row before any query reads
        return batch.kernel(q, k, v, pool.k(layer), pool.v(layer), None,
                            batch.gather_slots, batch.key_counts, batch.query_rows, **kw)
    pool.write(layer, batch.write_slots, k.to(pool.dtype), v.to(pool.dtype))
    cd = batch.compute_dtype
    if cd is not None and cd is not q.dtype:  # e.g. float32 where bf16 matmuls are slow
        return _torch_attention(q.to(cd), k.to(cd), v.to(cd), layer, batch, pool, scale).to(q.dtype)
    return _torch_attention(q, k, v, layer, batch, pool, scale)


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                     batch: AttnBatch, pool: KVPool, scale: float | None) -> torch.Tensor:
    """The torch path, computing in q's dtype (the pool's rows are converted to it)."""
    if batch.shape is AttnShape.DECODE:
        B, L = batch.gather_slots.shape
        Hkv, D = k.shape[1], k.shape[2]
        if batch.head_rows is None:
            heads = torch.arange(Hkv, device=batch.gather_slots.device).view(1, Hkv, 1)
            batch.head_rows = (batch.gather_slots.view(B, 1, L) * Hkv + heads).view(-1)
        kk = pool.k(layer).view(-1, D).index_select(0, batch.head_rows).view(B, Hkv, L, D)
        vv = pool.v(layer).view(-1, D).index_select(0, batch.head_rows).view(B, Hkv, L, D)
        return _decode_attention(q, kk.to(q.dtype), vv.to(q.dtype), batch, scale)
    return torch.cat([_sequence_attention(q, k, v, span, layer, pool, scale) for span in batch.spans])


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      batch: AttnBatch, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k, v [B, Hkv, L, D] -> [B, Hq*D]. Query head h reads KV head h // G."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if q.device.type != "cpu" or q.dtype not in REDUCED_PRECISION or B < GEMM_DECODE_MIN_BATCH:
        # the query heads sharing a KV head become its query rows: one SDPA call, no repeat
        mask = None if batch.mask is None else batch.mask.view(B, 1, 1, L)
        out = F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, Hq * D)
    # bf16/fp16 on CPU: SDPA's kernel spends its time on B*Hkv tiny products; two batched
    # matmuls over (sequence, KV head) with that head's G query rows are ~2x faster here.
    # Scores round to q's dtype as in HF's eager attention; softmax runs in float32.
    scores = torch.bmm(q.reshape(B * Hkv, G, D), k.view(B * Hkv, L, D).transpose(1, 2))
    scores = scores.view(B, Hkv, G, L)
    alpha = D ** -0.5 if scale is None else scale
    scores = scores.float().mul_(alpha) if batch.key_bias is None else \
        torch.add(batch.key_bias, scores, alpha=alpha)
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(B * Hkv, G, L)
    return torch.bmm(probs, v.view(B * Hkv, L, D)).view(B, Hq * D)


def _sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: SeqSpan,
                        layer: int, pool: KVPool, scale: float | None = None) -> torch.Tensor:
    """Attention of one sequence's new tokens (flat rows of q/k/v) -> [new, Hq*D]."""
    rows = slice(span.start, span.start + span.new)
    if span.slots is None and q.device.type == "cpu" and q.dtype in REDUCED_PRECISION \
            and span.new <= GEMM_PREFILL_MAX_LEN:
        return _causal_matmul_attention(q[rows], k[rows], v[rows], scale)
    # 4-D [1, H, T, D]: with 3-D inputs and enable_gqa, CPU SDPA falls back to its slow math path
    qq = q[rows].transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    if span.slots is None:
        kk, vv = k[rows], v[rows]
        mask = None
    else:
        kk = pool.k(layer).index_select(0, span.slots).to(q.dtype)
        vv = pool.v(layer).index_select(0, span.slots).to(q.dtype)
        mask = span.mask
    out = F.scaled_dot_product_attention(qq, kk.transpose(0, 1).unsqueeze(0),
                                         vv.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                         is_causal=mask is None, enable_gqa=gqa, scale=scale)
    return out[0].transpose(0, 1).reshape(span.new, -1)


def _causal_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """Causal self-attention of n new tokens with no prefix: q [n, Hq, D], k/v [n, Hkv, D] ->
    [n, Hq*D]. Per KV head, its G query heads' rows in one matmul (~2.5x SDPA's CPU bf16
    kernel at n = 80-130); scores round to q's dtype, softmax in float32, as in decode."""
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qq = q.reshape(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
    scores = torch.bmm(qq, k.permute(1, 2, 0)).view(Hkv, G, n, n)
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
    scores = scores.float().mul_(D ** -0.5 if scale is None else scale).masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(Hkv, G * n, n)
    out = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, G*n, D]
    return out.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, Hq * D)
