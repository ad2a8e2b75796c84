"""Request migration: a decode that fails after its stream began hands the answer to another pair.

`StreamRelay` sits between one decode's SSE body and the client. It forwards whole events only,
strips the `pdserve-progress` comment lines (core/migration_wire.py) after noting the output ids
each event's text covers, and holds back a decode's error event (or a body that ends without
`[DONE]`) as the failure. `Migration` keeps, across every decode of one request, what the
client has seen: the ids, the reply identity, whether any text went out untracked (then the
answer cannot be continued exactly), and whether it already ended. `continuation()` is the body
for the next pair: the client's body plus those ids; the server generates after prompt + ids
with what is left of the budget and streams on from the same text offset (server/resume.py).

A request that showed the client nothing yet (not streamed, or before its first event) moves
as a new try of the whole request. A stream that showed text moves only when it can be continued
exactly; not (the failure is reported, naming why) with logprobs (their earlier values are not
carried), completions echo, presence/frequency penalties (they count output tokens only; the
continued ids would count as prompt), structured outputs and forced tool calls (the grammar
would start over at the continued ids), batches and n > 1 (one stream per item would have to
move). Greedy output equals an uninterrupted run; a sampled one continues with fresh randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.migration_wire import PROGRESS_FIELD, PROGRESS_PREFIX, RESUME_FIELD

from .legs import LegError, LegErrorKind, upstream_error_object, upstream_error_text
from .pd_body import RequestShape, Route, decode
from .upstream import Upstream

_DONE_EVENT = b"data: [DONE]"
_ERROR_EVENT = b'data: {"error"'
_PENALTIES = ("presence_penalty", "frequency_penalty")
# constrained decoding (OpenAI/vLLM/SGLang spellings): a continuation's grammar would start over
# at the continued ids, so such a stream does not move
_GRAMMAR_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "json_schema", "regex", "ebnf", "structural_tag")


def _nonzero(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0


def blocker(shape: RequestShape, body: dict) -> str | None:
    """Why a stream of this request cannot be continued on another decode (None: it can)."""
    if shape.room_count is not None:
        return "batched input and n > 1 are not migrated"
    if shape.return_logprob:
        return "return_logprob streams are not migrated"
    if shape.route is Route.GENERATE:
        sp = body.get("sampling_params")
        sampling = sp if isinstance(sp, dict) else {}
    else:
        sampling = body
        lp = body.get("logprobs")
        if lp is not None and lp is not False:
            return "logprobs streams are not migrated"
        if body.get("echo"):
            return "echo streams are not migrated"
        rf, choice = body.get("response_format"), body.get("tool_choice")
        if (isinstance(rf, dict) and rf.get("type") not in (None, "text")) or choice == "required" \
                or isinstance(choice, dict):
            return "structured output streams are not migrated (the grammar would start over)"
    if any(sampling.get(name) is not None for name in _GRAMMAR_FIELDS):
        return "structured output streams are not migrated (the grammar would start over)"
    for name in _PENALTIES:
        if _nonzero(sampling.get(name)):
            return f"{name} counts output tokens only; a continued stream would count them as prompt"
    return None


@dataclass
class Migration:
    """What one client request's stream has shown, across every decode that served it."""

    blocker: str | None = None  # set: progress is not asked for and the stream cannot move
    enabled: bool = True  # --migration-limit > 0
    ids: list[int] = field(default_factory=list)  # output ids whose text the client has
    identity: dict = field(default_factory=dict)  # rid, and OpenAI's id and created
    forwarded: bool = False  # a data event reached the client
    untracked: bool = False  # ... one whose ids are unknown (no progress line)
    done: bool = False  # the answer ended (its finish event went out)
    count: int = 0  # migrations so far
    failed_decodes: set[str] = field(default_factory=set)  # answered it with an error: never again

    @property
    def wants_progress(self) -> bool:
        return self.enabled and self.blocker is None

    def refusal(self) -> str | None:
        """Why the stream so far cannot be continued exactly (None: it can)."""
        if self.done:
            return "the answer had already ended"
        if self.forwarded and self.untracked:
            return self.blocker or "the decode server does not report stream progress"
        return None

    def note(self, progress: dict) -> None:
        ids = progress.get("ids")
        if isinstance(ids, list):
            self.ids.extend(ids)
        for key in ("rid", "id", "created"):
            if key in progress and key not in self.identity:
                self.identity[key] = progress[key]
        if progress.get("done"):
            self.done = True


def request_body(body: dict, m: Migration, stream: bool) -> dict:
    """The first try's body: the client's, asking for progress lines when the stream may move."""
    return {**body, PROGRESS_FIELD: True} if stream and m.wants_progress else body


def continuation(body: dict, m: Migration, stream: bool) -> dict:
    """The body for the next pair. Nothing shown yet (or not streamed): the request again. Else
    the client's body plus the ids shown, the reply identity and the same rid."""
    out = request_body(body, m, stream)
    if not (stream and m.forwarded):
        return out
    out = dict(out)
    out[RESUME_FIELD] = {"ids": list(m.ids), "id": m.identity.get("id"), "created": m.identity.get("created")}
    if isinstance(m.identity.get("rid"), str):
        out["rid"] = m.identity["rid"]
    return out


class StreamRelay:
    """One decode's SSE body -> the bytes to forward (whole events, progress lines stripped).

    After each `feed`, `failure` is set when the decode sent an error event (its events before it
    are still returned); `end()` makes a body that stopped without `[DONE]` a failure too."""

    def __init__(self, m: Migration, upstream: Upstream):
        self.m, self.upstream = m, upstream
        self._buf = b""
        self.saw_done = False
        self.failure: LegError | None = None

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf + chunk if self._buf else chunk
        out, pos = [], 0
        while self.failure is None:
            end = buf.find(b"\n\n", pos)
            if end < 0:
                break
            event = self._event(buf[pos:end + 2])
            if event:
                out.append(event)
            pos = end + 2
        self._buf = b"" if self.failure is not None else buf[pos:]
        return b"".join(out)

    def end(self) -> None:
        """The body ended: without [DONE] (or with a partial event) the decode broke off."""
        if self.failure is None and not self.saw_done:
            self.failure = LegError(self.upstream, LegErrorKind.CONNECTION, 502,
                                    f"decode server {self.upstream.url} ended its stream before [DONE]",
                                    "upstream_connection_error")

    def _event(self, event: bytes) -> bytes:
        tracked = event.startswith(PROGRESS_PREFIX)
        if tracked:
            nl = event.index(b"\n")
            try:
                progress = decode(event[len(PROGRESS_PREFIX):nl])
            except Exception:
                progress = None
            if isinstance(progress, dict):
                self.m.note(progress)
            else:
                tracked = False
            event = event[nl + 1:]
        if event.startswith(_DONE_EVENT):
            self.saw_done = True
        elif event.startswith(_ERROR_EVENT):
            self.failure = self._error(event)
            return b""
        elif event.startswith(b"data:"):
            self.m.forwarded = True
            self.m.untracked |= not tracked
        return event

    def _error(self, event: bytes) -> LegError:
        raw = event[len(b"data: "):].strip()
        message, etype = upstream_error_text(raw)
        status = 500
        try:
            code = decode(raw)["error"].get("code")
            if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
                status = code
        except Exception:
            pass
        return LegError(self.upstream, LegErrorKind.STATUS, status,
                        f"decode server {self.upstream.url} failed mid-stream: {message}", etype or "upstream_error",
                        upstream_error_object(raw))
