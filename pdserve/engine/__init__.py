"""The engine: model, paged KV pool, scheduler, sampler. Knows nothing of prefill/decode."""
