"""What a router and a server say to each other to migrate a stream (internal, pdserve only).

- `pdserve_progress: true` in a streamed request asks the server to put, in front of each data
  event, one SSE comment line `: pdserve-progress {...}` with the output ids that event's text
  covers (ids added since the last line), whether the answer is finished, and on the first line
  the reply's identity (rid; OpenAI's id and created). Comment and data share one event, so a
  router that forwards whole events always knows exactly which ids the client has seen.
- `pdserve_resume: {"ids": [...], "id": ..., "created": ...}` in a continuation asks the server to
  continue an answer from those ids: it generates after prompt + ids, counts them as output, and
  streams on from where the client is (same reply id, no repeated text).

SSE clients ignore comment lines; the router strips them anyway. Stdlib only: both sides use it.
"""

from __future__ import annotations

import json
from typing import Any

PROGRESS_FIELD = "pdserve_progress"
RESUME_FIELD = "pdserve_resume"
PROGRESS_PREFIX = b": pdserve-progress "


def progress_line(ids: list[int], done: bool, identity: dict[str, Any] | None = None) -> bytes:
    """The comment line that goes in front of a data event (ends with a newline)."""
    obj: dict[str, Any] = {"ids": ids, "done": done}
    if identity:
        obj.update(identity)
    return PROGRESS_PREFIX + json.dumps(obj, separators=(",", ":")).encode() + b"\n"
