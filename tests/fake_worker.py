"""A torch-free stand-in for `pdserve.worker` that speaks the same ZMQ protocol (tests only).

Run as `python -m tests.fake_worker --dp-rank R --config-json J --model-dir D --in-addr A
--out-addr B`, like the real worker. Tokens are deterministic (`fake_generate`): next =
(prev * 31 + 7) % vocab from the prompt's last id; it honours max_new_tokens, stop_token_ids,
ignore_eos and the EOS id of config.json, reserves KV pages per request (freed on finish and
abort) so stats look real, and answers every GenerateReq with exactly one finished output.
Knobs (environment): FAKE_WORKER_STEP_S seconds per decode step (default 0.002),
FAKE_WORKER_FAIL_RANK send WorkerFailed, FAKE_WORKER_EXIT_RANK exit silently at start,
FAKE_WORKER_HANG_RANK never get ready, FAKE_WORKER_ERROR_TOKEN a prompt holding this id fails
with a 500 ErrorInfo. Stats `extra` counts requests seen and requests aborted.

`write_fake_model(dir)` writes the tiny model directory front tests use (tokenizer.json,
tokenizer_config.json with a chat template, config.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import zmq

from pdserve.core.messages import (
    AbortReq,
    ErrorInfo,
    GenerateReq,
    OutputBatch,
    ShutdownReq,
    StatsReq,
    TokenOutput,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello world! héllo wörld, naïve café, façade, Ελληνικά, русский текст.",
    "日本語のテキストと中文的文本，你好，世界。 emoji 🙂🚀✨ and math ∑∫√.",
    "def add(a, b):\n    return a + b  # numbers 0123456789",
    "Once upon a time there was a small model that served tokens quickly and correctly.",
] * 20


def build_bytelevel_tokenizer(vocab_size: int = 400):
    """A small byte-level BPE (SmolLM2/Llama 3 style); ids 0..2 are the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_fake_model(path: str, max_context: int = 256) -> dict:
    """Write the fake model directory; returns its config.json content."""
    os.makedirs(path, exist_ok=True)
    tok = build_bytelevel_tokenizer()
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos_token_id": 2,
           "max_position_embeddings": max_context, "architectures": ["FakeForCausalLM"]}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
               "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
               "clean_up_tokenization_spaces": False, "model_max_length": max_context}
    for name, obj in (("config.json", cfg), ("tokenizer_config.json", tok_cfg)):
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f)
    return cfg


def next_token(prev: int, vocab: int) -> int:
    return (prev * 31 + 7) % vocab


def fake_generate(prompt: list[int], max_new: int, vocab: int, eos: int | None,
                  stop_ids: tuple[int, ...] = (), ignore_eos: bool = False) -> tuple[list[int], dict]:
    """What the fake worker generates for a prompt: (token ids, finish_reason)."""
    out: list[int] = []
    prev = prompt[-1]
    while len(out) < max_new:
        prev = next_token(prev, vocab)
        out.append(prev)
        if prev in stop_ids or (prev == eos and not ignore_eos):
            return out, {"type": "stop", "matched": prev}
    return out, {"type": "length", "length": max_new}


def fake_logprob(token: int) -> float:
    return -((token % 7) + 1) / 8.0


@dataclass
class _Req:
    req: GenerateReq
    pages: int
    out: list[int] = field(default_factory=list)
    sent_first: bool = False


class FakeWorker:
    def __init__(self, rank: int, cfg: dict, model_dir: str, in_addr: str, out_addr: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            mcfg = json.load(f)
        self.rank = rank
        self.vocab = mcfg["vocab_size"]
        self.eos = mcfg.get("eos_token_id")
        self.page_size = cfg["page_size"]
        self.max_context = cfg["context_length"] or mcfg["max_position_embeddings"]
        self.total_pages = (cfg["max_total_tokens"] // self.page_size if cfg["max_total_tokens"]
                            else int(os.environ.get("FAKE_WORKER_PAGES", "64")))
        self.free_pages = self.total_pages
        self.step_s = float(os.environ.get("FAKE_WORKER_STEP_S", "0.002"))
        err = os.environ.get("FAKE_WORKER_ERROR_TOKEN")
        self.error_token = int(err) if err else None
        self.running: dict[str, _Req] = {}
        self.waiting: deque[GenerateReq] = deque()
        self.seen = 0
        self.aborts = 0
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(in_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(out_addr)

    def send(self, msg) -> None:
        self.outbox.send(pickle.dumps(msg))

    def run(self) -> None:
        parent = os.getppid()
        self.send(WorkerReady(self.rank, self.total_pages, self.page_size, self.max_context,
                              {"vocab_size": self.vocab, "fake": True}))
        next_step = time.monotonic()
        while os.getppid() == parent:  # the front died: do not linger as an orphan
            busy = self.running or self.waiting
            wait_s = max(0.0, next_step - time.monotonic()) if busy else 0.05
            outs: list[TokenOutput] = []
            if self.inbox.poll(int(wait_s * 1000)):
                while True:
                    try:
                        msg = pickle.loads(self.inbox.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if isinstance(msg, ShutdownReq):
                        return
                    outs.extend(self.handle(msg))
            outs.extend(self.admit())
            if time.monotonic() >= next_step:  # decode steps keep their own clock
                next_step = time.monotonic() + self.step_s
                outs.extend(self.step())
            if outs:
                self.send(OutputBatch(self.rank, outs))

    def handle(self, msg) -> list[TokenOutput]:
        if isinstance(msg, GenerateReq):
            self.seen += 1
            self.waiting.append(msg)
        elif isinstance(msg, AbortReq):
            return self.abort(msg.rid, msg.reason)
        elif isinstance(msg, StatsReq):
            self.send(WorkerStats(msg.req_id, self.rank, self.total_pages, self.free_pages, 0, len(self.running),
                                  len(self.waiting), 0, {"fake": True, "requests_seen": self.seen,
                                                         "requests_aborted": self.aborts}))
        return []

    def abort(self, rid: str, reason: str) -> list[TokenOutput]:
        done = TokenOutput(rid, finished=True, finish_reason={"type": "abort", "message": reason})
        if rid in self.running:
            self.free_pages += self.running.pop(rid).pages
            self.aborts += 1
            return [done]
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                self.aborts += 1
                return [done]
        return []

    def admit(self) -> list[TokenOutput]:
        outs = []
        while self.waiting:
            req = self.waiting[0]
            need = -(-(len(req.input_ids) + req.sampling.max_new_tokens) // self.page_size)
            fail = None
            if self.error_token is not None and self.error_token in req.input_ids:
                fail = ErrorInfo(500, f"fake worker rank {self.rank} fails rid {req.rid} on purpose", "worker_error")
            elif need > self.total_pages:
                fail = ErrorInfo(400, f"rid {req.rid} needs {need} KV pages; rank {self.rank} has "
                                      f"{self.total_pages}", "invalid_request_error")
            if fail is not None:
                self.waiting.popleft()
                outs.append(TokenOutput(req.rid, finished=True, error=fail,
                                        finish_reason={"type": "abort", "message": fail.message}))
                continue
            if need > self.free_pages:
                break
            self.waiting.popleft()
            self.free_pages -= need
            self.running[req.rid] = _Req(req, need)
        return outs

    def step(self) -> list[TokenOutput]:
        outs = []
        for rid, r in list(self.running.items()):
            req, sp = r.req, r.req.sampling
            out = TokenOutput(rid)
            if not r.sent_first:
                r.sent_first = True
                out.prompt_tokens = len(req.input_ids)
                out.meta = {"dp_rank": self.rank, "dispatch_reason": req.dispatch_reason,
                            "pd": None if req.pd is None else asdict(req.pd),
                            "fake_sampling": {k: getattr(sp, k) for k in (
                                "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                                "ignore_eos", "stop_token_ids")}}
                if req.return_logprob:
                    out.input_logprobs = [None] + [fake_logprob(t) for t in req.input_ids[1:]]
            if len(r.out) < sp.max_new_tokens:
                tok = next_token(r.out[-1] if r.out else req.input_ids[-1], self.vocab)
                r.out.append(tok)
                out.token_ids = [tok]
                if req.return_logprob:
                    out.token_logprobs = [fake_logprob(tok)]
                if tok in sp.stop_token_ids or (tok == self.eos and not sp.ignore_eos):
                    out.finished, out.finish_reason = True, {"type": "stop", "matched": tok}
            if not out.finished and len(r.out) >= sp.max_new_tokens:
                out.finished, out.finish_reason = True, {"type": "length", "length": sp.max_new_tokens}
            if out.finished:
                self.free_pages += self.running.pop(rid).pages
            outs.append(out)
        return outs


def main(argv=None) -> None:
    import signal

    p = argparse.ArgumentParser(prog="python -m tests.fake_worker")
    for name in ("--dp-rank", "--config-json", "--model-dir", "--in-addr", "--out-addr"):
        p.add_argument(name, required=True, type=int if name == "--dp-rank" else str)
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when we stop
    rank = a.dp_rank
    if os.environ.get("FAKE_WORKER_EXIT_RANK") == str(rank):
        sys.exit(7)
    if os.environ.get("FAKE_WORKER_HANG_RANK") == str(rank):
        signal.pause()
    worker = FakeWorker(rank, json.loads(a.config_json), a.model_dir, a.in_addr, a.out_addr)
    if os.environ.get("FAKE_WORKER_FAIL_RANK") == str(rank):
        worker.send(WorkerFailed(rank, f"fake start-up failure on rank {rank}"))
    else:
        worker.run()
    worker.inbox.close(0)
    worker.outbox.close()
    worker.ctx.term()


if __name__ == "__main__":
    main()
