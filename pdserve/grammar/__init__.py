"""Structured outputs on llguidance: specs -> grammars (checked without a tokenizer, so the
front can refuse a bad one with a 400), and per-sequence matchers that fill token bitmasks.
No torch here: the engine applies the masks to its logits."""
