"""The worker loop's order within one turn, with fakes (no model, no processes): outputs a role
has ready before the engine steps (a decode's first token from a handoff that just landed) are
sent before the step, not with its tokens one step later."""

from __future__ import annotations

from pdserve.core.messages import OutputBatch, TokenOutput
from pdserve.worker.loop import WorkerLoop


class FakeEngine:
    def __init__(self, log: list):
        self.log, self.seqs, self.steps_left = log, {}, 1

    def has_work(self) -> bool:
        return self.steps_left > 0

    def step(self):
        self.log.append("step")
        self.steps_left -= 1
        return ["stepped"]


class FakeRole:
    def __init__(self, ready: list[TokenOutput]):
        self.ready = ready

    def busy(self) -> bool:
        return False

    def poll(self) -> list[TokenOutput]:
        out, self.ready = self.ready, []
        return out

    def on_step(self, stepped) -> list[TokenOutput]:
        return [TokenOutput("a", [2])]


class FakeChannel:
    def __init__(self, log: list, loop_holder: list):
        self.log, self.loop_holder = log, loop_holder

    def recv_all(self, timeout: float) -> list:
        return []

    def send(self, batch: OutputBatch) -> None:
        self.log.append([(o.rid, o.token_ids) for o in batch.outputs])
        if self.loop_holder[0].engine.steps_left == 0:
            self.loop_holder[0].running = False


def run_one(ready: list[TokenOutput]) -> list:
    log: list = []
    holder: list = []
    loop = WorkerLoop(FakeEngine(log), FakeRole(ready), FakeChannel(log, holder), dp_rank=0)
    holder.append(loop)
    loop.run()
    return log


def test_ready_outputs_go_out_before_the_step():
    assert run_one([TokenOutput("a", [1])]) == [[("a", [1])], "step", [("a", [2])]]


def test_nothing_ready_sends_only_the_step():
    assert run_one([]) == ["step", [("a", [2])]]
