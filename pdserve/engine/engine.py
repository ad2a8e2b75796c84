"""The engine: one model, one KV pool, continuous batching. Knows nothing of prefill/decode.

Life of a request: add() queues it; step() runs one scheduled batch (a prefill chunk or a
decode step), samples, checks stops and returns StepOutputs; finished requests free their
pages unless they asked to hold them (hold_kv), in which case release() frees them later.
Freed full pages stay in the prefix cache (prefix_cache.py) for later requests to reuse,
until eviction needs them or flush_cache() forgets them.
KV import for another engine's prefill: reserve() pages, fill them from outside, then
add_prefilled() continues decoding from the given first token.
Structured outputs: a request whose sampling has a grammar gets a matcher (grammar_mask.py) that
masks the sampler's logits each step and is advanced by every token emitted, add_prefilled's
first token included; the request ends as a stop once the grammar allows nothing more.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..core.errors import BadRequest
from ..core.logprobs import MAX_TOP_LOGPROBS, TopLogprobs
from ..core.page_keys import chain_hashes
from .allocator import PageAllocator
from .attention import AttnBatch
from .cpu_kernels import PagedAttentionKernel
from .cpu_plan import AttentionPaths, CpuPlan, static_plan
from .grammar_mask import EngineGrammar
from .kv_pool import KVPool
from .linear import MatmulPath
from .logprobs import logprobs_of
from .prefix_cache import PrefixCache
from .sampler import make_generator, sample
from .scheduler import Batch, Scheduler
from .sequence import SeqStatus, Sequence
from .step_io import EngineRequest, EngineStats, StepOutput


@dataclass(frozen=True)
class EngineConfig:
    num_pages: int
    page_size: int = 16
    max_running: int = 64
    prefill_budget: int = 512  # prompt tokens per step (--chunked-prefill-size)
    max_batched_tokens: int = 0  # decode + prompt tokens per step (--max-num-batched-tokens; 0: no cap)
    max_context: int = 8192
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    prefix_cache: bool = True


class Engine:
    def __init__(self, model: torch.nn.Module, pool: KVPool, cfg: EngineConfig,
                 device: str | torch.device = "cpu",
                 attention_kernel: PagedAttentionKernel | None = None, grammars=None,
                 plan: CpuPlan | None = None):
        self.model = model
        self.grammar = EngineGrammar(grammars)  # grammars: grammar.matcher.Matchers, None: refused
        if attention_kernel is not None and not attention_kernel.supports_model(
                pool.dtype, model.cfg.num_heads, pool.num_kv_heads, pool.head_dim):
            attention_kernel = None  # e.g. head_dim 80: the torch path
        self.attention_kernel = attention_kernel  # see cpu_kernels.load_paged_attention
        # plan: what calibration chose for this CPU (None: our kernel wherever it was built)
        self.plan = plan or static_plan(model.matmul, attention_kernel is not None, model.fused is not None)
        self.attention = AttentionPaths(self.plan, attention_kernel)
        self.pool = pool
        self.cfg = cfg
        self.device = torch.device(device)
        self.allocator = PageAllocator(cfg.num_pages)
        self.cache = PrefixCache(self.allocator, cfg.page_size, cfg.prefix_cache)
        self.scheduler = Scheduler(self.cache, cfg.page_size, cfg.max_running, cfg.prefill_budget,
                                   cfg.max_batched_tokens)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, list[int]] = {}  # finished hold_kv requests and reservations

    # ---- requests -------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise BadRequest(f"request {req.rid}: empty prompt")
        total = n + req.sampling.max_new_tokens
        if total > self.cfg.max_context:
            raise BadRequest(f"request {req.rid}: prompt ({n} tokens) + max_new_tokens "
                             f"({req.sampling.max_new_tokens}) exceeds the context length "
                             f"{self.cfg.max_context}")
        if self.scheduler.pages_for(total) > self.cfg.num_pages:
            raise BadRequest(f"request {req.rid}: needs {total} tokens of KV, more than the pool "
                             f"holds ({self.cfg.num_pages * self.cfg.page_size})")
        if req.rid in self.seqs or req.rid in self.held:
            raise BadRequest(f"request id {req.rid} is already in use")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"request {req.rid}: top_logprobs={req.top_logprobs} is out of range "
                             f"[0, {MAX_TOP_LOGPROBS}]")
        self.grammar.check(req.rid, req.sampling)
        vocab = self.cfg.vocab_size
        bad = next((t for t, _ in req.sampling.logit_bias if t >= vocab), None) if vocab else None
        if bad is not None:
            raise BadRequest(f"request {req.rid}: logit_bias token id {bad} is outside the "
                             f"vocabulary [0, {vocab})")

    def add(self, req: EngineRequest) -> None:
        self.validate(req)
        seq = Sequence(req, generator=make_generator(req.sampling.seed))
        self.grammar.attach(seq)
        if req.wants_prompt_logprobs:
            seq.input_logprobs = [None]
            seq.input_top_logprobs = [None] if req.top_logprobs else None
        self.seqs[req.rid] = seq
        self.scheduler.waiting.append(seq)

    def abort(self, rid: str) -> bool:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.scheduler.remove(seq)
        return (self.release(rid) or seq is not None)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            total_pages=self.cfg.num_pages,
            free_pages=self.allocator.free_count,
            cached_pages=self.cache.cached_pages,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            held_pages=sum(len(p) for p in self.held.values()),
            cache=self.cache.counters(),
        )

    def flush_cache(self) -> int:
        """Forget every cached prefix (requests in flight keep their pages); -> pages freed."""
        return self.cache.flush()

    # ---- KV import/export -----------------------------------------------------------------
    def reserve(self, rid: str, num_tokens: int) -> list[int] | None:
        """Pages for num_tokens tokens, held under rid until release() or add_prefilled()."""
        if rid in self.held or rid in self.seqs:
            raise BadRequest(f"request id {rid} is already in use")
        pages = self.cache.alloc(self.scheduler.pages_for(num_tokens))
        if pages is not None:
            self.held[rid] = pages
        return pages

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """Prompt tokens a prefill of `prompt_ids` here would take from the prefix cache now
        (full pages, at most up to one token before the end; nothing is pinned)."""
        if not self.cache.enabled:
            return 0
        page = self.scheduler.page_size
        usable = (len(prompt_ids) - 1) // page
        return self.cache.peek(chain_hashes(prompt_ids[:usable * page], page, [])) * page

    def reserve_prompt(self, rid: str, prompt_ids: list[int]) -> tuple[list[int], int, str] | None:
        """Pages for a prompt whose KV will arrive from elsewhere, reusing the longest run of its
        full pages this engine's prefix cache holds (they are pinned under rid, so no eviction
        can touch them before add_prefilled() or release()). -> (pages, reused pages, hex key
        of the last reused page or ""), or None when the pool cannot hold the rest now."""
        if rid in self.held or rid in self.seqs:
            raise BadRequest(f"request id {rid} is already in use")
        page = self.scheduler.page_size
        keys = chain_hashes(prompt_ids, page, []) if self.cache.enabled else []
        reused = self.cache.match(keys)
        fresh = self.cache.alloc(self.scheduler.pages_for(len(prompt_ids)) - len(reused))
        if fresh is None:
            self.cache.release(reused)
            return None
        self.cache.count_lookup(len(prompt_ids), len(reused) * page)
        self.held[rid] = reused + fresh
        return reused + fresh, len(reused), keys[len(reused) - 1].hex() if reused else ""

    def release(self, rid: str) -> bool:
        pages = self.held.pop(rid, None)
        if pages is None:
            return False
        self.cache.release(pages)
        return True

    def add_prefilled(self, req: EngineRequest, first_token: int, first_logprob: float | None = None,
                      first_top: TopLogprobs | None = None, prompt_logprobs: list[float | None] | None = None,
                      prompt_top: list[TopLogprobs | None] | None = None) -> StepOutput:
        """Continue a request whose prompt KV is already in the pages reserved under req.rid, from
        the first token another engine sampled (with its logprob and alternatives); the prompt's
        logprobs computed there, when given, go out with the first output. max_new_tokens=0
        (echo of the prompt's logprobs only) finishes at once without that token."""
        pages = self.held.pop(req.rid)
        seq = Sequence(req, generator=make_generator(req.sampling.seed), pages=pages,
                       num_computed=len(req.prompt_ids), status=SeqStatus.RUNNING,
                       input_logprobs=prompt_logprobs, input_top_logprobs=prompt_top)
        seq.cached_tokens = 0
        self.grammar.attach(seq)  # _emit advances it by the first token
        self.scheduler.offer_full_pages(seq)
        self.seqs[req.rid] = seq
        self.scheduler.running.append(seq)
        if req.sampling.max_new_tokens == 0:
            return self._finish(seq, None, None, {"type": "length", "length": 0})
        return self._emit(seq, first_token, first_logprob, first_top)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        with self._matmul_kernels(sum(batch.new_lens)):
            return self._run(batch)

    def _matmul_kernels(self, num_tokens: int):
        """A one-token step is matrix-vector products: on CPU PyTorch's own bf16 kernel streams
        the weights ~1.5x faster than oneDNN's on plain weights (SmolLM2, AVX512-BF16); oneDNN
        wins from two rows, and at every row count once the weights are packed."""
        if num_tokens != 1 or self.device.type != "cpu" or \
                self.model.matmul is not MatmulPath.TORCH or not torch.backends.mkldnn.enabled:
            return contextlib.nullcontext()
        return _onednn_off()

    def _run(self, batch: Batch) -> list[StepOutput]:
        ids, positions = [], []
        for seq, n in zip(batch.seqs, batch.new_lens):
            start = seq.num_computed
            ids.extend(seq.tokens(start, start + n))
            positions.extend(range(start, start + n))
        seq_lens = [s.num_computed + n for s, n in zip(batch.seqs, batch.new_lens)]
        kernel, compute_dtype = self.attention.for_step(
            max(batch.new_lens) == 1, max((n for n, new in zip(seq_lens, batch.new_lens) if new > 1), default=0))
        attn = AttnBatch.build(seq_lens, batch.new_lens, [s.pages for s in batch.seqs],
                               self.cfg.page_size, self.device, kernel,
                               rope_lens=[s.num_tokens for s in batch.seqs], compute_dtype=compute_dtype)
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(positions, device=self.device), attn, self.pool)
        return self._account(batch, hidden)

    def _account(self, batch: Batch, hidden: torch.Tensor) -> list[StepOutput]:
        """Count each sequence's computed tokens and sample the ones that need a token: every
        decode, and each prefill that reached the end of its prompt."""
        outs: list[StepOutput] = []
        sampled, rows, t = [], [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.new_lens)):
            if i < batch.num_decode:
                seq.num_computed += 1
                self.scheduler.offer_full_pages(seq)
                sampled.append(seq)
                rows.append(t)
            else:
                if seq.input_logprobs is not None and seq.num_computed < len(seq.req.prompt_ids):
                    self._input_logprobs(seq, hidden[t:t + n])
                if self.scheduler.after_prefill(seq, n):
                    if seq.req.sampling.max_new_tokens == 0:
                        outs.append(self._finish(seq, None, None, {"type": "length", "length": 0}))
                    else:
                        sampled.append(seq)
                        rows.append(t + n - 1)
            t += n
        if sampled:
            h = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=hidden.device)]
            outs.extend(self._sample_and_emit(sampled, self.model.raw_logits(h)))
        return outs

    def _input_logprobs(self, seq: Sequence, h: torch.Tensor) -> None:
        """Logprobs (and alternatives, when asked) of the prompt tokens this chunk predicts
        (hidden row i predicts position start + i + 1), skipping positions already recorded
        before a preemption."""
        start = seq.num_computed
        first = max(start + 1, len(seq.input_logprobs))
        end = min(start + 1 + h.shape[0], len(seq.req.prompt_ids))
        if first >= end:
            return
        rows = h[first - 1 - start:end - 1 - start]
        targets = torch.tensor(seq.req.prompt_ids[first:end], device=rows.device)
        lps, tops = logprobs_of(self.model.raw_logits(rows), targets, [seq.req.top_logprobs] * (end - first))
        seq.input_logprobs.extend(lps)
        if seq.input_top_logprobs is not None:
            seq.input_top_logprobs.extend(tops)

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        tokens = sample(logits, [s.req.sampling for s in seqs], [s.generator for s in seqs],
                        [s.history for s in seqs], self.cfg.eos_token_ids, self.grammar.masks(seqs))
        logprobs, tops = None, None
        if any(s.req.return_logprob for s in seqs):
            logprobs, tops = logprobs_of(logits, tokens, [s.req.top_logprobs for s in seqs])
        tokens = tokens.tolist()
        return [self._emit(s, tokens[i], logprobs[i] if logprobs else None, tops[i] if tops else None)
                for i, s in enumerate(seqs)]

    def _emit(self, seq: Sequence, token: int, logprob: float | None,
              top: TopLogprobs | None = None) -> StepOutput:
        seq.append_output(token)
        p = seq.req.sampling
        reason = self.grammar.refused(seq, token)
        if reason is not None:
            pass
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.cfg.eos_token_ids):
            reason = {"type": "stop", "matched": token}
        elif self.grammar.complete(seq):  # nothing but EOS may follow: done without that step
            reason = {"type": "stop", "matched": None}
        elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.cfg.max_context:
            reason = {"type": "length", "length": len(seq.output_ids)}
        if reason is not None:
            return self._finish(seq, token, logprob, reason, top)
        return self._output(seq, token, logprob, top)

    def _output(self, seq: Sequence, token: int | None, logprob: float | None,
                top: TopLogprobs | None = None, **kw) -> StepOutput:
        lp = seq.req.return_logprob
        out = StepOutput(seq.rid, token, logprob if lp else None, top_logprobs=top if lp else None,
                         prompt_tokens=len(seq.req.prompt_ids), cached_tokens=seq.cached_tokens or 0,
                         **kw)
        if seq.input_logprobs is not None and not seq.sent_input_logprobs:
            out.input_logprobs = seq.input_logprobs
            out.input_top_logprobs = seq.input_top_logprobs
            seq.sent_input_logprobs = True
        return out

    def _finish(self, seq: Sequence, token: int | None, logprob: float | None,
                reason: dict, top: TopLogprobs | None = None) -> StepOutput:
        hold = seq.req.hold_kv
        held = list(seq.pages) if hold else None
        self.scheduler.remove(seq, free_pages=not hold)
        self.seqs.pop(seq.rid, None)
        if hold:
            self.held[seq.rid] = held
        return self._output(seq, token, logprob, top, finished=True, finish_reason=reason,
                            held_pages=held)


@contextlib.contextmanager
def _onednn_off():
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True
