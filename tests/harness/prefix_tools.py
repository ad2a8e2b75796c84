"""What the prefix-cache tests share: the cached-token count a request must report."""

from __future__ import annotations


def expected_cached(prompt: list[int], earlier: list[list[int]], page: int) -> int:
    """Full pages of `prompt` that an earlier sequence computed (its prompt + all but its last
    output token), leaving one prompt token to compute."""
    best = 0
    for seen in earlier:
        n = 0
        while n < min(len(prompt), len(seen)) and prompt[n] == seen[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // page * page
