"""A prefill room: its states, the moves between them, and the data its events brought. The
events are prefill_events', the machine that moves rooms is prefill_machine.

A room's RoomState is the whole truth about it: which events it takes, whether a write may
still read its pages, whether its decode has spoken, how it is reported. TRANSITIONS lists the
moves (each checked; IllegalTransition otherwise); the rest of a room is data the events brought
(the KvReq, the decode's endpoint, pages, aux, the write's facts, reason and cause, times).
`room.handoff` is the room seen as a Handoff (HandoffState and when each was entered), derived
from its states and their times: what is reported (meta_info `prefill_<state>_s`).

  state \\ event     PrefillDone    KvReq              KvAbort | Fail, deadline   Drop       write ok  write error
  BOOTSTRAPPING     PREFILLED      WAITING_FOR_INPUT  FAILED* | FAILED_UNHEARD   DROPPED_U  -         -
  PREFILLED         .              TRANSFERRING       FAILED* | FAILED_UNHEARD   DROPPED_U  -         -
  WAITING_FOR_INPUT TRANSFERRING   . (duplicate)      FAILED*                    .          -         -
  TRANSFERRING      .              . (duplicate)      FAILING                    .          SUCCESS   FAILED*
  FAILING           .              . (duplicate)      .                          .          FAILED    FAILED*
  FAILED_UNHEARD    .              FAILED*            . (KvAbort: KvFail)        .          -         -
  DROPPED_UNHEARD   .              DROPPED*           . (KvAbort: KvFail)        .          -         -
  SUCCESS, FAILED, DROPPED: no moves; a KvAbort is answered with KvFail.
"*": the decode is sent KvFail. "." no move (PrefillDone still records pages and aux). "-" raises
IllegalTransition (a write result with no write out). In BOOTSTRAPPING and PREFILLED a KvReq is
checked first (compat, instance, doomed room, page counts, reused prefix key): a bad one goes to
FAILED*; so does a PrefillDone whose aux has no first token (no KvDone could follow the write).
MarkFailed acts as Fail. Tick applies the deadline, then reports and forgets every room
that ended with no write out (SUCCESS, FAILED[_UNHEARD], DROPPED[_UNHEARD]); a failed one is
remembered as doomed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.failures import FailureCause
from ..transfer.base import Endpoint, WriteResult
from . import wire
from .handoff import Handoff, HandoffState, IllegalTransition, Side

if TYPE_CHECKING:  # only named in an annotation: prefill_events builds its messages from rooms
    from .prefill_events import PrefillFacts

H = HandoffState


class RoomState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # accepted; no KvReq; the prompt is being prefilled
    PREFILLED = "prefilled"  # accepted; its pages hold the KV; no KvReq yet
    WAITING_FOR_INPUT = "waiting_for_input"  # the decode's KvReq is here; still prefilling
    TRANSFERRING = "transferring"  # the page write (then the KvDone) is out
    FAILING = "failing"  # failed while its write is out: pages held, the decode told when it returns
    SUCCESS = "success"  # the KvDone went out after the pages
    FAILED = "failed"  # no write can land any more; the decode has its answer
    FAILED_UNHEARD = "failed_unheard"  # failed before its decode spoke: a KvReq gets KvFail
    DROPPED_UNHEARD = "dropped_unheard"  # ended without a transfer (the decode prefilled it)
    DROPPED = "dropped"  # dropped, and a KvReq that came anyway was answered

    @property
    def handoff(self) -> HandoffState:
        """The HandoffState it is reported as."""
        return _HANDOFF[self]

    @property
    def live(self) -> bool:
        """Still heading for success: the bootstrap deadline applies and a failure moves it."""
        return self in _LIVE

    @property
    def writing(self) -> bool:
        """A page write is out: it may still read the pages and land in the decode's."""
        return self in (RoomState.TRANSFERRING, RoomState.FAILING)

    @property
    def finished(self) -> bool:
        """Ended with no write out: reported (and its pages released) at the next Tick."""
        return not self.live and not self.writing

    @property
    def unheard(self) -> bool:
        """Ended before its decode spoke: the decode's KvReq, when it comes, is answered."""
        return self in (RoomState.FAILED_UNHEARD, RoomState.DROPPED_UNHEARD)

    @property
    def dropped(self) -> bool:
        return self in (RoomState.DROPPED_UNHEARD, RoomState.DROPPED)

    @property
    def heard(self) -> RoomState:
        """Where an unheard room goes once its decode spoke (and was answered)."""
        return _HEARD[self]

    @property
    def waiting_for(self) -> str:
        """What a live room is waiting for, in words (for its deadline's reason)."""
        return _WAITING_FOR[self]


R = RoomState
_HANDOFF = {R.BOOTSTRAPPING: H.BOOTSTRAPPING, R.PREFILLED: H.BOOTSTRAPPING,
            R.WAITING_FOR_INPUT: H.WAITING_FOR_INPUT, R.TRANSFERRING: H.TRANSFERRING, R.SUCCESS: H.SUCCESS,
            R.FAILING: H.FAILED, R.FAILED: H.FAILED, R.FAILED_UNHEARD: H.FAILED,
            R.DROPPED_UNHEARD: H.FAILED, R.DROPPED: H.FAILED}
_LIVE = frozenset({R.BOOTSTRAPPING, R.PREFILLED, R.WAITING_FOR_INPUT, R.TRANSFERRING})
_HEARD = {R.FAILED_UNHEARD: R.FAILED, R.DROPPED_UNHEARD: R.DROPPED}
_WAITING_FOR = {R.BOOTSTRAPPING: "the decode's metadata (kv_req)", R.PREFILLED: "the decode's metadata (kv_req)",
                R.WAITING_FOR_INPUT: "the prefill to finish", R.TRANSFERRING: "the KV write"}

TRANSITIONS: dict[RoomState, frozenset[RoomState]] = {
    R.BOOTSTRAPPING: frozenset({R.PREFILLED, R.WAITING_FOR_INPUT, R.FAILED, R.FAILED_UNHEARD, R.DROPPED_UNHEARD}),
    R.PREFILLED: frozenset({R.TRANSFERRING, R.FAILED, R.FAILED_UNHEARD, R.DROPPED_UNHEARD}),
    R.WAITING_FOR_INPUT: frozenset({R.TRANSFERRING, R.FAILED}),
    R.TRANSFERRING: frozenset({R.SUCCESS, R.FAILING, R.FAILED}),
    R.FAILING: frozenset({R.FAILED}),
    R.FAILED_UNHEARD: frozenset({R.FAILED}),
    R.DROPPED_UNHEARD: frozenset({R.DROPPED}),
    R.SUCCESS: frozenset(),
    R.FAILED: frozenset(),
    R.DROPPED: frozenset(),
}


@dataclass
class PrefillRoom:
    """One accepted room. `state` decides everything; the rest is what the events brought."""

    room: int
    rid: str
    prompt_len: int
    prompt_ids: list[int] | None = None
    state: RoomState = RoomState.BOOTSTRAPPING
    entered: dict[RoomState, float] = field(default_factory=dict)  # state -> monotonic time
    req: wire.KvReq | None = None  # the decode's, once attached
    peer: Endpoint | None = None  # where the decode hears from us (None exactly until it spoke)
    pages: list[int] | None = None  # set when the prefill finished
    aux: PrefillFacts | None = None  # set when the prefill finished
    write: WriteResult | None = None  # what its page write did, when it came back ok
    reason: str = ""  # set with the first failure
    cause: FailureCause = FailureCause.INTERNAL
    stages: dict[str, float] = field(default_factory=dict)  # Stage value -> wall time

    @property
    def created(self) -> float:
        return self.entered[RoomState.BOOTSTRAPPING]

    @property
    def handoff(self) -> Handoff:
        """The room as a Handoff (its HandoffState, reason, when each was first entered): what
        is reported. A KvReq that found the prefill done passes WaitingForInput at once."""
        entered: dict[HandoffState, float] = {}
        for s, t in self.entered.items():  # visit order: the table only moves forward
            if s.handoff is H.TRANSFERRING:
                entered.setdefault(H.WAITING_FOR_INPUT, t)
            entered.setdefault(s.handoff, t)
        return Handoff(self.room, Side.PREFILL, state=self.state.handoff, reason=self.reason,
                       created=self.created, entered=entered)

    def move(self, to: RoomState, now: float, reason: str | None = None,
             cause: FailureCause = FailureCause.INTERNAL) -> None:
        """Enter `to` at `now` (a move of TRANSITIONS, else IllegalTransition); a `reason` (and
        its `cause`) replaces the room's."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"room {self.room} (prefill): illegal move {self.state.value} -> {to.value}"
                                    + (f" (failed: {self.reason})" if self.reason else ""))
        if reason is not None:
            self.reason, self.cause = reason, cause
        self.state = to
        self.entered[to] = now
