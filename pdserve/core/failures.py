"""Why a request failed, as a small closed set: the `cause` label of the failure metrics and the
`failure_cause` a worker reports with a failed item. Decided where the failure happens."""

from __future__ import annotations

import enum

CONFLICT_PREFIX = "follow_bootstrap_room conflict"  # the start of every conflict rejection message


class FailureCause(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # refused as invalid (4xx) before or at the worker
    CONFLICT = "conflict"  # a follow_bootstrap_room conflict rejected the room
    REJECTED = "rejected"  # the other leg refused the room for another reason
    ABORTED = "aborted"  # client gone, router cancel, or the peer aborted the room
    TIMEOUT = "timeout"  # a deadline passed (bootstrap, waiting, query, output)
    PEER_GONE = "peer_gone"  # heartbeat: the prefill server is gone or restarted
    INCOMPATIBLE = "incompatible"  # backend, layout, model or prompt differ between the legs
    RESOLVE = "resolve"  # the prefill topology, DP rank or endpoint could not be looked up
    TRANSFER = "transfer"  # sending the metadata or the KV failed
    NO_PAGES = "no_pages"  # the KV pool cannot hold the request
    WORKER_GONE = "worker_gone"  # a DP worker process died or the server is stopping
    INTERNAL = "internal"  # anything else

    @classmethod
    def parse(cls, value: object) -> "FailureCause":
        """A cause from the wire; unknown or missing values are INTERNAL."""
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL


def rejection_cause(reason: str) -> FailureCause:
    """The cause of a room the prefill front refused (it only passes the reason along)."""
    return FailureCause.CONFLICT if CONFLICT_PREFIX in reason else FailureCause.REJECTED


_BY_ERROR_TYPE = {
    "aborted": FailureCause.ABORTED,
    "timeout_error": FailureCause.TIMEOUT,
    "worker_error": FailureCause.WORKER_GONE,
    "unavailable_error": FailureCause.WORKER_GONE,
    "invalid_request_error": FailureCause.BAD_REQUEST,
}


def cause_of_error(error_type: str, status: int, reported: str | None) -> FailureCause:
    """The cause of an item that ended with an error: the worker's own report wins, else the
    error type (aborts, timeouts, dead workers, bad input), else INTERNAL."""
    if reported:
        return FailureCause.parse(reported)
    if error_type in _BY_ERROR_TYPE:
        return _BY_ERROR_TYPE[error_type]
    return FailureCause.BAD_REQUEST if 400 <= status < 500 else FailureCause.INTERNAL
