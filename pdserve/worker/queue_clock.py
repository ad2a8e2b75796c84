"""When each request entered this worker's engine (`queued`) and when the engine first ran a
forward step with it (`scheduled`): the queue time the front exports, and two timeline stages.

The worker loop calls `watch` for each request it takes, `before_step`/`after_step` around
every engine step, and `stamp` on every output batch, which carries the stages to the front.
A request counts as scheduled once its computed-token count moved (or it left the engine).
"""

from __future__ import annotations

from typing import Mapping, Protocol

from ..core.messages import TokenOutput
from ..core.timeline import Stage

QUEUED, SCHEDULED = Stage.QUEUED.value, Stage.SCHEDULED.value


class _Seq(Protocol):
    num_computed: int


class QueueClock:
    def __init__(self) -> None:
        self._base: dict[str, int | None] = {}  # rid -> num_computed when it entered the engine
        self._stamps: dict[str, dict[str, float]] = {}  # rid -> stages not yet sent

    def watch(self, rid: str) -> None:
        self._base[rid] = None

    def before_step(self, seqs: Mapping[str, _Seq], now: float) -> None:
        for rid, base in self._base.items():
            if base is None and (seq := seqs.get(rid)) is not None:
                self._base[rid] = seq.num_computed
                self._stamps.setdefault(rid, {})[QUEUED] = now

    def after_step(self, seqs: Mapping[str, _Seq], step_started: float) -> None:
        for rid in [r for r, base in self._base.items() if base is not None]:
            seq = seqs.get(rid)
            if seq is None or seq.num_computed != self._base[rid]:
                del self._base[rid]
                self._stamps[rid][SCHEDULED] = step_started

    def stamp(self, outs: list[TokenOutput]) -> None:
        """Attach the stages recorded so far to each request's next output; forget finished ones."""
        for out in outs:
            stages = self._stamps.pop(out.rid, None)
            if stages:
                out.timeline.update(stages)
            if out.finished:
                self._base.pop(out.rid, None)

    def pending(self) -> int:
        return len(self._base)
