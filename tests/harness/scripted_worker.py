"""A fake DP worker (fake_worker.py) whose answer is the text after the last `SAY:` in the
prompt, up to the end of that message (`<|im_end|>`), one token per step, then EOS: a test makes
the "model" write tool calls, <think> blocks or anything else. max_new_tokens still cuts it
(finish "length"); a prompt without `SAY:` gets the fake worker's own tokens. Start a front with
`--worker-module tests.harness.scripted_worker`."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from pdserve.core.config import ServerConfig

from .fake_engine import FakeEngine, FakeSeq
from .fake_worker import fake_engine, main

MARK, END = "SAY:", "<|im_end|>"


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose tokens come from the script in the prompt, where there is one."""

    def __init__(self, *args, tokenizer: Tokenizer, **kw):
        super().__init__(*args, **kw)
        self.tok = tokenizer
        self.scripts: dict[str, list[int]] = {}  # rid -> what it says, then EOS ([] : no script)

    def _script(self, seq: FakeSeq) -> list[int]:
        if seq.rid not in self.scripts:
            text = self.tok.decode(seq.req.prompt_ids, skip_special_tokens=False)
            at = text.rfind(MARK)
            said = "" if at < 0 else text[at + len(MARK):].split(END, 1)[0]
            self.scripts[seq.rid] = self.tok.encode(said, add_special_tokens=False).ids + list(self.eos_token_ids) \
                if said else []
        return self.scripts[seq.rid]

    def _next_token(self, seq: FakeSeq) -> int:
        script = self._script(seq)
        if len(seq.output_ids) < len(script):
            return script[len(seq.output_ids)]
        return super()._next_token(seq)

    def _remove(self, seq: FakeSeq, free_pages: bool) -> None:
        self.scripts.pop(seq.rid, None)
        super()._remove(seq, free_pages)


def scripted_engine(cfg: ServerConfig, model_dir: str) -> ScriptedEngine:
    return fake_engine(cfg, model_dir, ScriptedEngine,
                       tokenizer=Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")))


if __name__ == "__main__":
    main(make_engine=scripted_engine)
