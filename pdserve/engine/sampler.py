"""Token sampling: logit processors, then greedy, temperature, top-k, top-p, min-p, seeds.

Logit processors (vLLM's order and definitions, see core/sampling.py) run batched on the rows
whose params ask for one: logit_bias, min_new_tokens (EOS / stop ids masked), then
repetition_penalty over prompt + generated tokens, frequency and presence penalties over the
generated ones. A batch where no row asks for any costs nothing extra. The token history a row
needs is kept incrementally per sequence (`TokenHistory`), so a step never walks Python lists.
Rows under a grammar (structured outputs) get the tokens it does not allow set to -inf last
(grammar_mask.BatchMasks), so every sampling mode picks among allowed tokens only.
"""

from __future__ import annotations

import functools

import torch

from ..core.sampling import SamplingParams


class TokenHistory:
    """One sequence's prompt + generated token ids in a growing int64 buffer (CPU), appended
    as tokens are emitted; the prompt part is kept only when repetition_penalty needs it, and
    with store=False (min_new_tokens / logit_bias only) just the generated count."""

    def __init__(self, prompt_ids: list[int], keep_prompt: bool, capacity: int = 0, store: bool = True):
        prompt = prompt_ids if keep_prompt else []
        self.prompt_len = len(prompt)
        self.store = store
        self.buf = torch.empty(max(capacity, self.prompt_len + 16) if store else 0, dtype=torch.long)
        if prompt:
            self.buf[:self.prompt_len] = torch.tensor(prompt, dtype=torch.long)
        self.size = self.prompt_len

    @classmethod
    def for_params(cls, prompt_ids: list[int], p: SamplingParams) -> "TokenHistory | None":
        if not p.processes_logits:
            return None
        if not p.penalizes:
            return cls([], False, store=False)
        keep = p.repetition_penalty != 1.0
        room = min(p.max_new_tokens, 1 << 14)  # the buffer grows past that if needed
        return cls(prompt_ids, keep, (len(prompt_ids) if keep else 0) + room)

    def append(self, token: int) -> None:
        if not self.store:
            self.size += 1
            return
        if self.size == self.buf.numel():
            grown = torch.empty(2 * self.size, dtype=torch.long)
            grown[:self.size] = self.buf
            self.buf = grown
        self.buf[self.size] = token
        self.size += 1

    @property
    def num_generated(self) -> int:
        return self.size - self.prompt_len

    def all_tokens(self) -> torch.Tensor:
        assert self.store, "this history keeps no tokens"
        return self.buf[:self.size]

    def generated(self) -> torch.Tensor:
        assert self.store, "this history keeps no tokens"
        return self.buf[self.prompt_len:self.size]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[TokenHistory | None] | None = None,
           eos_token_ids: tuple[int, ...] = (), masks=None) -> torch.Tensor:
    """logits [B, V] (any float dtype; rows nobody processes are not converted) -> token ids [B]
    (long, CPU). `histories[i]` is required for rows whose params process logits. `masks`
    (grammar_mask.BatchMasks) blocks the tokens each grammar row's grammar does not allow."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    processed = None
    if rows:
        assert histories is not None, "logit processors need the sequences' token histories"
        processed = process_logits(logits, rows, params, histories, eos_token_ids)
        if masks is not None:
            masks.apply(processed, rows)
    if all(p.greedy for p in params):
        # max(dim).indices: the first maximum, as argmax, but vectorized for bfloat16 (~5x faster)
        if processed is None:
            return logits.max(dim=-1).indices.cpu()
        if len(rows) == len(params):
            return processed.max(dim=-1).indices.cpu()
        out = logits.max(dim=-1).indices.cpu()
        out[rows] = processed.max(dim=-1).indices.cpu()
        return out
    where = {i: j for j, i in enumerate(rows)}
    out = torch.empty(len(params), dtype=torch.long)
    for i, (p, g) in enumerate(zip(params, generators)):
        row = logits[i] if i not in where else processed[where[i]]
        if p.greedy:
            out[i] = int(row.argmax())
            continue
        out[i] = _sample_row(row, p, g)
    return out


def process_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                   histories: list[TokenHistory | None], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """The processed float32 logits of `rows` ([len(rows), V]; `logits` is left as it was)."""
    dev = logits.device
    idx = torch.tensor(rows, device=dev) if len(rows) != logits.shape[0] else None
    x = (logits if idx is None else logits.index_select(0, idx)).float()
    if x.data_ptr() == logits.data_ptr():
        x = x.clone()
    vocab = x.shape[1]
    ps = [params[i] for i in rows]
    hs = [histories[i] for i in rows]

    # 1. logit_bias: x[r, t] += bias (ids unique per row)
    biased = [j for j, p in enumerate(ps) if p.logit_bias]
    if biased:
        parts = [_bias_tensors(ps[j].logit_bias) for j in biased]
        t = torch.cat([ids for ids, _ in parts])
        b = torch.cat([vals for _, vals in parts])
        r = torch.repeat_interleave(torch.tensor(biased), torch.tensor([ids.numel() for ids, _ in parts]))
        keep = t < vocab
        r, t, b = r[keep].to(dev), t[keep].to(dev), b[keep].to(dev, x.dtype)
        x[r, t] += b
    # 2. min_new_tokens: EOS (unless ignore_eos, as vLLM) and stop_token_ids -> -inf
    masked = []
    for j, (p, h) in enumerate(zip(ps, hs)):
        if p.min_new_tokens > h.num_generated:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            masked.extend((j, t) for t in stops if 0 <= t < vocab)
    if masked:
        r, t = zip(*masked)
        x[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    # 3. repetition_penalty over prompt + generated tokens (HF / vLLM); only the (row, token)
    # pairs a history holds are touched, so the cost follows the histories, not rows x vocab
    rep = [j for j, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rep:
        r, t, _ = _pairs([hs[j].all_tokens() for j in rep], rep, vocab, dev, unique=False)
        pen = torch.tensor([p.repetition_penalty for p in ps], dtype=x.dtype, device=dev)[r]
        v = x[r, t]  # a repeated pair reads the same value and writes the same result
        x[r, t] = torch.where(v > 0, v / pen, v * pen)
    # 4. frequency * count + presence * [count > 0] over the generated tokens (OpenAI)
    fp = [j for j, p in enumerate(ps) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if fp:
        r, t, count = _pairs([hs[j].generated() for j in fp], fp, vocab, dev)
        if r.numel():
            freq = torch.tensor([p.frequency_penalty for p in ps], dtype=x.dtype, device=dev)[r]
            pres = torch.tensor([p.presence_penalty for p in ps], dtype=x.dtype, device=dev)[r]
            x[r, t] -= freq * count.to(x.dtype) + pres
    return x


@functools.lru_cache(maxsize=256)
def _bias_tensors(logit_bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (token ids, biases) CPU tensors, built once per distinct map."""
    return (torch.tensor([t for t, _ in logit_bias], dtype=torch.long),
            torch.tensor([b for _, b in logit_bias], dtype=torch.float32))


def _pairs(tokens: list[torch.Tensor], rows: list[int], vocab: int, dev: torch.device,
           unique: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The (row, token id) pairs of rows[k] with tokens[k] (ids outside the vocabulary dropped)
    -> (rows, token ids, occurrences) on `dev`: distinct pairs with their counts, or with
    unique=False every occurrence and no counts."""
    lens = torch.tensor([t.numel() for t in tokens])
    flat = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long)
    which = torch.repeat_interleave(torch.tensor(rows), lens)
    keep = (flat >= 0) & (flat < vocab)
    if not unique:
        return which[keep].to(dev), flat[keep].to(dev), None
    key = (which[keep] * vocab + flat[keep]).to(dev)
    key, count = torch.unique(key, return_counts=True)
    return key // vocab, key % vocab, count


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row.float() / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g
