"""A torch-free stand-in for `pdserve.worker` (tests only): the real worker loop, channel and
colocated role (pdserve/worker/loop.py, pump.py, colocated.py) over a FakeEngine
(fake_engine.py), so a front meets the real worker's side of the ZMQ protocol in a process that
starts in a blink.

Run as `python -m tests.harness.fake_worker --dp-rank R --config-json J --model-dir D
--in-addr A --out-addr B`, like the real worker (front flag `--worker-module
tests.harness.fake_worker`). Tokens are deterministic (`fake_generate`): next =
(prev * 31 + 7) % vocab from the prompt's last id; max_new_tokens, stop_token_ids, ignore_eos
and the EOS id of config.json hold; the pool has --max-total-tokens (else FAKE_WORKER_PAGES,
default 64 pages). What front tests read: the first output of each request carries in `meta`
the rank, dispatch reason, PD params and sampling params (`fake_sampling`) the worker got, and
the stats' `extra` counts requests seen and aborted.
Knobs (environment): FAKE_WORKER_STEP_S seconds per engine step (default 0.002),
FAKE_WORKER_FAIL_RANK send WorkerFailed, FAKE_WORKER_EXIT_RANK exit silently at start,
FAKE_WORKER_HANG_RANK never get ready, FAKE_WORKER_ERROR_TOKEN a prompt holding this id fails
with a 500 worker_error.

`write_fake_model(dir)` writes the tiny model directory front tests use (tokenizer.json,
tokenizer_config.json with a chat template, config.json).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict
from typing import Callable

from pdserve.core.config import ServerConfig, config_from_json
from pdserve.core.envs import Envs
from pdserve.core.messages import GenerateReq, TokenOutput, WorkerFailed, WorkerReady
from pdserve.engine.step_io import StepOutput
from pdserve.worker.__main__ import parse_args
from pdserve.worker.colocated import ColocatedRole
from pdserve.worker.loop import WorkerLoop
from pdserve.worker.pump import WorkerChannel
from pdserve.worker.role import RoleContext, error_output

from .fake_engine import (
    FakeEngine,
    FakeModelConfig,
    fake_logprob,  # noqa: F401  (front tests expect the worker's logprobs)
    next_token,
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


class FakeRole(ColocatedRole):
    """The colocated role plus what front tests read: a prompt holding `error_token` fails on
    purpose, counters of requests seen and aborted, and the request as this worker got it on
    its first output."""

    def __init__(self, ctx: RoleContext, error_token: int | None = None):
        super().__init__(ctx)
        self.error_token = error_token
        self.seen = 0
        self.aborted = 0
        self._first: dict[str, dict] = {}  # rid -> meta for its first output

    def on_generate(self, req: GenerateReq) -> list[TokenOutput]:
        self.seen += 1
        if self.error_token is not None and self.error_token in req.input_ids:
            return [error_output(req.rid, 500, f"fake worker rank {self.dp_rank} fails rid {req.rid} on purpose",
                                 "worker_error")]
        outs = super().on_generate(req)
        if not outs:
            sp = req.sampling
            self._first[req.rid] = {
                "dp_rank": self.dp_rank, "dispatch_reason": req.dispatch_reason,
                "pd": None if req.pd is None else asdict(req.pd),
                "fake_sampling": {k: getattr(sp, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k",
                                                              "min_p", "seed", "ignore_eos", "stop_token_ids")}}
        return outs

    def on_abort(self, rid: str, reason: str) -> list[TokenOutput]:
        self._first.pop(rid, None)
        outs = super().on_abort(rid, reason)
        self.aborted += bool(outs)
        return outs

    def on_step(self, outs: list[StepOutput]) -> list[TokenOutput]:
        tokens = super().on_step(outs)
        for t in tokens:
            if (meta := self._first.pop(t.rid, None)) is not None:
                t.meta.update(meta)
        return tokens

    def stats_extra(self) -> dict:
        return {"fake": True, "requests_seen": self.seen, "requests_aborted": self.aborted}


def fake_engine(cfg: ServerConfig, model_dir: str, engine_cls: type[FakeEngine] = FakeEngine, **kw) -> FakeEngine:
    """The engine a fake worker serves with, sized from the server's flags and config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        mcfg = json.load(f)
    pages = (cfg.max_total_tokens // cfg.page_size if cfg.max_total_tokens
             else int(os.environ.get("FAKE_WORKER_PAGES", "64")))
    eos = mcfg.get("eos_token_id")
    return engine_cls(pages, cfg.page_size, vocab_size=mcfg["vocab_size"],
                      max_context=cfg.context_length or mcfg["max_position_embeddings"],
                      max_running=cfg.max_running_requests, eos_token_ids=() if eos is None else (eos,),
                      step_s=float(os.environ.get("FAKE_WORKER_STEP_S", "0.002")), **kw)


def main(argv=None, make_engine: Callable[[ServerConfig, str], FakeEngine] = fake_engine) -> None:
    """The real worker's start-up (pdserve/worker/__main__.py) with a fake engine and FakeRole."""
    a = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when we stop
    rank = a.dp_rank
    if os.environ.get("FAKE_WORKER_EXIT_RANK") == str(rank):
        sys.exit(7)
    if os.environ.get("FAKE_WORKER_HANG_RANK") == str(rank):
        signal.pause()
    cfg = config_from_json(a.config_json)
    channel = WorkerChannel(a.in_addr, a.out_addr)
    try:
        if os.environ.get("FAKE_WORKER_FAIL_RANK") == str(rank):
            channel.send(WorkerFailed(rank, f"fake start-up failure on rank {rank}"))
            return
        engine = make_engine(cfg, a.model_dir)
        err = os.environ.get("FAKE_WORKER_ERROR_TOKEN")
        role = FakeRole(RoleContext(engine, rank, cfg, Envs.read(), FakeModelConfig(), channel.wake),
                        int(err) if err else None)
        channel.send(WorkerReady(rank, engine.num_pages, engine.page_size, engine.max_context,
                                 {"vocab_size": engine.vocab_size, "fake": True}))
        WorkerLoop(engine, role, channel, rank).run()
    finally:
        channel.close()


if __name__ == "__main__":
    main()
