"""A fake DP worker (tests/fake_worker.py) whose answer is the text after the last `SAY:` in the
prompt, up to the end of that message (`<|im_end|>`), one token per step, then EOS: a test makes
the "model" write tool calls, <think> blocks or anything else. max_new_tokens still cuts it
(finish "length"); a prompt without `SAY:` gets the fake worker's own tokens. Start a front with
`--worker-module tests.scripted_worker`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_worker import FakeWorker  # noqa: E402

from pdserve.core.messages import TokenOutput  # noqa: E402

MARK, END = "SAY:", "<|im_end|>"


class ScriptedWorker(FakeWorker):
    def __init__(self, *args):
        super().__init__(*args)
        self.tok = Tokenizer.from_file(os.path.join(args[2], "tokenizer.json"))
        self.scripts: dict[str, list[int]] = {}

    def _script(self, rid: str, prompt: list[int]) -> list[int]:
        if rid not in self.scripts:
            text = self.tok.decode(prompt, skip_special_tokens=False)
            at = text.rfind(MARK)
            said = "" if at < 0 else text[at + len(MARK):].split(END, 1)[0]
            self.scripts[rid] = self.tok.encode(said, add_special_tokens=False).ids + [self.eos] if said else []
        return self.scripts[rid]

    def step(self) -> list[TokenOutput]:
        scripted = {rid: r for rid, r in self.running.items() if self._script(rid, r.req.input_ids)}
        for rid in scripted:  # the fake's own step runs the others
            del self.running[rid]
        outs = super().step()
        self.running.update(scripted)
        for rid, r in scripted.items():
            ids, sp = self.scripts[rid], r.req.sampling
            out = TokenOutput(rid, prompt_tokens=0 if r.out else len(r.req.input_ids))
            tok = ids[len(r.out)]
            r.out.append(tok)
            out.token_ids = [tok]
            if tok == self.eos:
                out.finished, out.finish_reason = True, {"type": "stop", "matched": tok}
            elif len(r.out) >= sp.max_new_tokens:
                out.finished, out.finish_reason = True, {"type": "length", "length": sp.max_new_tokens}
            if out.finished:
                self.free_pages += self.running.pop(rid).pages
                self.scripts.pop(rid, None)
            outs.append(out)
        return outs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.scripted_worker")
    for name in ("--dp-rank", "--config-json", "--model-dir", "--in-addr", "--out-addr"):
        p.add_argument(name, required=True, type=int if name == "--dp-rank" else str)
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when we stop
    worker = ScriptedWorker(a.dp_rank, json.loads(a.config_json), a.model_dir, a.in_addr, a.out_addr)
    worker.run()
    worker.inbox.close(0)
    worker.outbox.close()
    worker.ctx.term()


if __name__ == "__main__":
    main()
