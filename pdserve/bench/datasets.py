"""Benchmark prompts: synthetic random-length prompts, shared-prefix prompt groups, or
conversations read from a local file.

Token counts come from a local tokenizer.json (the `tokenizers` library) when one is given,
otherwise from whitespace-separated words (an approximation). Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# A fixed vocabulary for synthetic prompts: common words, so every tokenizer sees plain text.
WORDS: tuple[str, ...] = tuple("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education river garden window paper music table light bridge mountain
forest ocean island valley village market street station engine signal cloud stone bread apple
orange silver golden quiet bright gentle rapid simple careful honest happy green blue yellow small
large early late young old new long short high low open clear warm cold soft strong heavy fresh
walk run read write speak listen build carry follow bring begin finish choose explain measure
travel answer remember notice gather share teach learn allow offer improve produce protect
""".split())


@dataclass(frozen=True)
class Message:
    """One chat message (`role` is "system", "user" or "assistant")."""

    role: str
    content: str


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: `prompt_len` is its token count, `output_len` the tokens to ask for.

    `messages`, when set, is the same prompt as a chat (multi-turn); the chat backend sends it,
    completion-style backends send `prompt`, its text framing."""

    prompt: str
    prompt_len: int
    output_len: int
    messages: tuple[Message, ...] = ()


class TokenCounter:
    """Counts tokens with a local tokenizer.json, or whitespace words when none is given."""

    def __init__(self, tokenizer_path: str | None = None):
        self._tok = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json at {tokenizer_path}")
            self._tok = Tokenizer.from_file(str(path))

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count(self, text: str) -> int:
        if self._tok is None:
            return len(text.split())
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def truncate(self, text: str, n_tokens: int) -> str:
        """The longest prefix of `text` holding at most `n_tokens` tokens, cut at a token end."""
        if self._tok is None:
            return " ".join(text.split()[:n_tokens])
        enc = self._tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= n_tokens:
            return text
        return text[: enc.offsets[n_tokens - 1][1]]


def sample_lengths(rng: random.Random, target: int, range_ratio: float) -> int:
    """A length uniform in [max(1, target * range_ratio), target] (SGLang's semantics)."""
    low = max(1, int(target * range_ratio))
    return rng.randint(low, max(low, target))


def words_text(rng: random.Random, n_tokens: int, counter: TokenCounter, head: str = "") -> str:
    """`head` (if any), then random WORDS, `n_tokens` tokens in all: exact in words; with a
    tokenizer drawn long, cut at a token end and regrown when the cut re-tokenizes short."""
    need = n_tokens - (counter.count(head) if head else 0)
    # Words usually hold >= 1 token each; draw extra so the tokenizer can trim to n_tokens.
    words = " ".join(rng.choices(WORDS, k=max(1, need) if not counter.exact else max(1, need) + 8))
    text = counter.truncate(f"{head} {words}" if head else words, n_tokens)
    for _ in range(4 if counter.exact else 0):  # a cut mid-word can re-tokenize shorter
        if counter.count(text) >= n_tokens:
            break
        text = counter.truncate(text + " " + " ".join(rng.choices(WORDS, k=8)), n_tokens)
    return text


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int, counter: TokenCounter) -> list[BenchRequest]:
    """Synthetic prompts of random words with input/output lengths drawn from the ranges."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = sample_lengths(rng, input_len, range_ratio)
        n_out = sample_lengths(rng, output_len, range_ratio)
        text = words_text(rng, n_in, counter)
        out.append(BenchRequest(prompt=text, prompt_len=counter.count(text), output_len=n_out))
    return out


def distinct_texts(rng: random.Random, count: int, n_tokens: int, counter: TokenCounter,
                   taken: set[str] | None = None, head: str = "") -> list[str]:
    """`count` words_text texts (each `head`, then its own words) whose first own words (first
    two when count > len(WORDS)) all differ, so no two share more than `head`; texts in `taken`
    are skipped and the new ones added to it."""
    k = 1 if count <= len(WORDS) else 2
    start = f"{head} " if head else ""
    taken = set() if taken is None else taken
    keys: set[tuple[str, ...]] = set()
    out: list[str] = []
    for _ in range(50 * count + 100):
        if len(out) == count:
            break
        text = words_text(rng, n_tokens, counter, head)
        key = tuple(text[len(start):].split()[:k])
        if text.startswith(start) and len(key) == k and key not in keys and text not in taken:
            keys.add(key)
            taken.add(text)
            out.append(text)
    if len(out) < count:
        raise ValueError(f"cannot make {count} distinct texts of {n_tokens} tokens; "
                         "use longer texts or fewer of them")
    return out


def shared_prefix_requests(num_prefixes: int, suffixes_per_prefix: int, prefix_len: int,
                           suffix_len: int, output_len: int, seed: int,
                           counter: TokenCounter) -> list[BenchRequest]:
    """`num_prefixes` x `suffixes_per_prefix` prompts "prefix suffix" (vLLM's prefix_repetition).

    Prefixes differ from their first word on, so only same-prefix prompts can share a cache;
    the suffixes of one prefix differ from their first word too. The order is shuffled with
    `seed`, so same-prefix requests are interleaved rather than sent back to back."""
    if min(num_prefixes, suffixes_per_prefix, prefix_len, suffix_len, output_len) < 1:
        raise ValueError("prefix and suffix counts and lengths and output_len must be >= 1")
    rng = random.Random(seed)
    prefixes = distinct_texts(rng, num_prefixes, prefix_len, counter)
    taken: set[str] = set()
    out = []
    for prefix in prefixes:  # the suffix is counted in place, so prompts are prefix_len + suffix_len
        for text in distinct_texts(rng, suffixes_per_prefix, prefix_len + suffix_len, counter,
                                   taken, head=prefix):
            out.append(BenchRequest(prompt=text, prompt_len=counter.count(text), output_len=output_len))
    rng.shuffle(out)
    return out


def _turns(item: dict) -> list[str]:
    convs = item.get("conversations") or item.get("conversation") or item.get("messages") or []
    texts = []
    for turn in convs:
        if isinstance(turn, dict):
            value = turn.get("value", turn.get("content"))
            if isinstance(value, str):
                texts.append(value)
    return texts


def _load_items(path: Path) -> Iterable[dict]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return [d for d in data if isinstance(d, dict)]
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON line: {e}") from None
            if isinstance(obj, dict):
                items.append(obj)
    return items


def file_requests(path: str, num_prompts: int, seed: int, counter: TokenCounter,
                  fixed_output_len: int = 0) -> list[BenchRequest]:
    """Requests from a JSON list or JSONL file.

    Accepts ShareGPT-style {"conversations": [{"from"|"role", "value"|"content"}, ...]}
    (prompt = first turn, output length = tokens of the second turn) and
    {"prompt": str, "output_len": int}. `fixed_output_len` > 0 overrides the output length.
    Items are shuffled with `seed` and the first `num_prompts` usable ones are kept.
    """
    items = list(_load_items(Path(path)))
    random.Random(seed).shuffle(items)
    out: list[BenchRequest] = []
    for item in items:
        if len(out) >= num_prompts:
            break
        if isinstance(item.get("prompt"), str):
            prompt, out_len = item["prompt"], item.get("output_len", fixed_output_len or 0)
        else:
            turns = _turns(item)
            if len(turns) < 2 and not (turns and fixed_output_len):
                continue
            prompt = turns[0]
            out_len = fixed_output_len or counter.count(turns[1])
        if fixed_output_len:
            out_len = fixed_output_len
        if not prompt.strip() or not isinstance(out_len, int) or out_len < 1:
            continue
        out.append(BenchRequest(prompt=prompt, prompt_len=counter.count(prompt), output_len=out_len))
    if not out:
        raise ValueError(f"{path}: no usable prompts (need a prompt and an output length >= 1)")
    return out
