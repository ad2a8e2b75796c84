"""Error types that cross layers; each maps to an HTTP status and a JSON error body."""

from __future__ import annotations

from typing import Any


class PDServeError(Exception):
    """Base error: `status` is the HTTP status to answer with, `type` the error type string."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.status}}


class BadRequest(PDServeError):
    """The client sent something invalid; the server keeps serving."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(PDServeError):
    status = 401
    type = "authentication_error"


class NotFound(PDServeError):
    status = 404
    type = "not_found_error"


class Overloaded(PDServeError):
    status = 429
    type = "overloaded_error"


class Unavailable(PDServeError):
    """Not ready yet (e.g. bootstrap before every rank registered)."""

    status = 503
    type = "unavailable_error"


class HandoffFailed(PDServeError):
    """A PD handoff failed; the message names the room, the ranks and the cause."""

    status = 500
    type = "handoff_error"


class Timeout(PDServeError):
    status = 504
    type = "timeout_error"
