"""A tiny random-weight Llama with a real byte-level tokenizer, written as an HF directory.

Weights are O(1) (HF's own init makes near-uniform logits, where greedy ties would hide
mismatches), so greedy outputs are distinct and a wrong KV page changes the tokens.
"""

from __future__ import annotations

import json
import os

from .fake_worker import write_fake_model


def make_tiny_model(path: str, seed: int = 0, max_context: int = 512, layers: int = 2,
                    hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> str:
    import torch
    import transformers

    info = write_fake_model(path, max_context=max_context)  # tokenizer.json, tokenizer_config.json
    cfg = transformers.LlamaConfig(
        vocab_size=info["vocab_size"], hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_context, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "bos_token_id": 1}, f)
    return path
