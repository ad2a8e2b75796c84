"""The multi-turn workload: conversations whose every turn resends the whole history.

A turn's prompt holds the earlier user messages and the answers the server actually streamed
back, so a prefix cache can reuse the previous turn; with a system prompt every conversation
starts with the same one, so first turns share it too. Turns of one conversation go out one
after another (the next once the last has finished); conversations run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from .arrivals import gather_on_schedule
from .datasets import BenchRequest, Message, TokenCounter, distinct_texts, words_text
from .metrics import RequestRecord


@dataclass(frozen=True)
class Conversation:
    """One chat: `questions[t]` is the user message of turn t; each reply asks `output_len` tokens;
    `system` (if any) opens every turn's prompt."""

    index: int
    questions: tuple[str, ...]
    output_len: int
    system: str = ""


def make_conversations(num: int, turns: int, first_len: int, question_len: int, output_len: int,
                       seed: int, counter: TokenCounter, system_len: int = 0) -> list[Conversation]:
    """Synthetic chats: first messages that differ from their first word on (no two
    conversations share a prefix beyond the system prompt), then shorter follow-up questions;
    `system_len` > 0: a system prompt of that many tokens, the same in every conversation."""
    if min(num, turns, first_len, question_len, output_len) < 1:
        raise ValueError("conversations, turns, message lengths and output_len must be >= 1")
    if system_len < 0:
        raise ValueError("the system prompt's length must be >= 0")
    rng = random.Random(seed)
    firsts = distinct_texts(rng, num, first_len, counter)
    # its own generator, so the messages are those of the same seed without a system prompt
    system = words_text(random.Random(f"system-{seed}"), system_len, counter) if system_len else ""
    return [Conversation(i, (first, *(words_text(rng, question_len, counter) for _ in range(turns - 1))),
                         output_len, system) for i, first in enumerate(firsts)]


_FRAMES = {"system": "System: {}\n", "user": "User: {}\nAssistant:", "assistant": "{}\n"}


def frame(messages: tuple[Message, ...]) -> str:
    """Completion-style text "[System: s\\n]User: q\\nAssistant:a\\nUser: q2\\nAssistant:". The
    answer follows "Assistant:" verbatim, so a turn's prompt plus its answer starts the next
    turn's prompt."""
    return "".join(_FRAMES[m.role].format(m.content) for m in messages)


def turn_request(conv: Conversation, answers: list[str], counter: TokenCounter) -> BenchRequest:
    """The request of turn len(answers): the system prompt (if any), the history with those
    answers, then the next question."""
    msgs: list[Message] = [Message("system", conv.system)] if conv.system else []
    for question, answer in zip(conv.questions, answers):
        msgs += [Message("user", question), Message("assistant", answer)]
    msgs.append(Message("user", conv.questions[len(answers)]))
    prompt = frame(tuple(msgs))
    return BenchRequest(prompt=prompt, prompt_len=counter.count(prompt), output_len=conv.output_len,
                        messages=tuple(msgs))


# send(index, request, scheduled_time) -> (record, streamed text)
TurnSender = Callable[[int, BenchRequest, float], Awaitable[tuple[RequestRecord, str]]]


@dataclass
class ConversationRun:
    records: list[RequestRecord]  # every turn sent, in (conversation, turn) order
    not_sent: int  # turns skipped because an earlier turn of their conversation failed


async def run_conversations(convs: list[Conversation], offsets: list[float], t0: float,
                            send: TurnSender, counter: TokenCounter, max_concurrency: int = 0,
                            progress: Callable[[int], None] = lambda n: None) -> ConversationRun:
    """Start conversation i at `t0 + offsets[i]`; it holds one of `max_concurrency` slots
    (0 = no cap) from its first turn to its last. A failed turn ends its conversation."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    turns = max(len(c.questions) for c in convs)

    async def one(i: int) -> tuple[list[RequestRecord], int]:
        conv, answers, records = convs[i], [], []
        scheduled = offsets[i]
        async with sem if sem is not None else contextlib.nullcontext():
            for t in range(len(conv.questions)):
                rec, text = await send(conv.index * turns + t, turn_request(conv, answers, counter),
                                       scheduled)
                rec.conversation, rec.turn = conv.index, t
                records.append(rec)
                progress(1)
                if not rec.success:
                    left = len(conv.questions) - t - 1
                    progress(left)
                    return records, left
                answers.append(text)
                scheduled = time.perf_counter() - t0
        return records, 0

    done = await gather_on_schedule(offsets, t0, one)
    return ConversationRun([r for recs, _ in done for r in recs], sum(n for _, n in done))
