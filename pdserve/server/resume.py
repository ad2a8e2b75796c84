"""Continuing a migrated answer (core/migration_wire.py): parse `pdserve_resume`, turn it into a
continuation item, and write the `pdserve-progress` lines a router needs to migrate a stream.

A continuation of an answer whose first k tokens were streamed elsewhere is generated after
prompt + those k ids with what is left of its budget (max_new_tokens - k, min_new_tokens - k),
and its ItemProgress replays the k ids first (request_state.py), so text, held-back stop-string
prefixes, output ids and usage continue exactly where the old server was. Exact for greedy and
for repetition_penalty (prompt + output is the same set of tokens); presence/frequency penalties
count output tokens only, which a continuation would count as prompt: the router does not
migrate those (router/migration.py), and a seeded sampler restarts its stream of random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import BadRequest
from ..core.migration_wire import PROGRESS_FIELD, RESUME_FIELD, progress_line
from ..core.sampling import SamplingParams


@dataclass(frozen=True)
class Resume:
    """The part of an answer already streamed (ids), and the reply identity to keep."""

    ids: tuple[int, ...]
    reply_id: str | None = None  # OpenAI's "id" of the chunks already sent
    created: int | None = None


def parse_resume(body: dict) -> Resume | None:
    raw = body.get(RESUME_FIELD)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"{RESUME_FIELD} must be an object")
    ids = raw.get("ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise BadRequest(f"{RESUME_FIELD}.ids must be a list of non-negative integers")
    reply_id, created = raw.get("id"), raw.get("created")
    if reply_id is not None and not isinstance(reply_id, str):
        raise BadRequest(f"{RESUME_FIELD}.id must be a string")
    if created is not None and (isinstance(created, bool) or not isinstance(created, int)):
        raise BadRequest(f"{RESUME_FIELD}.created must be an integer")
    return Resume(tuple(ids), reply_id, created)


def continue_sampling(sp: SamplingParams, resume: Resume) -> SamplingParams:
    """What is left of the budget once `resume.ids` were generated."""
    k = len(resume.ids)
    if k >= sp.max_new_tokens:
        raise BadRequest(f"{RESUME_FIELD} has {k} tokens, max_new_tokens is {sp.max_new_tokens}: nothing "
                         "is left to generate")
    return sp.replace(max_new_tokens=sp.max_new_tokens - k, min_new_tokens=max(0, sp.min_new_tokens - k))


def check_resumable(num_prompts: int, n: int) -> None:
    if num_prompts != 1 or n != 1:
        raise BadRequest(f"{RESUME_FIELD} continues one answer: the request must have one prompt and n=1")


def wants_progress(body: dict) -> bool:
    v = body.get(PROGRESS_FIELD)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{PROGRESS_FIELD} must be a boolean")
    return bool(v)


class ProgressLines:
    """Per item, the ids reported so far; `line()` gives the comment for the next data event."""

    def __init__(self, identity: dict | None = None):
        self.identity = identity or {}
        self._reported: dict[str, int] = {}

    def line(self, rid: str, output_ids: list[int], upto: int, done: bool, resumed: int = 0) -> bytes:
        """Report output_ids[last reported:upto]; the first line of an item names its identity."""
        first = rid not in self._reported
        start = self._reported.get(rid, resumed)
        self._reported[rid] = max(start, upto)
        return progress_line(output_ids[start:upto], done, {"rid": rid, **self.identity} if first else None)
