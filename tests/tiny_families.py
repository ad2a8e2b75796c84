"""Tiny random-weight models of each supported family, made with transformers' own config
classes: the configs, O(1) random weights, and a servable directory (byte-level tokenizer
from fake_worker) for end-to-end tests. Windows, soft-caps, q/k norms, partial and scaled
RoPE are sized so that short prompts and outputs pass every threshold."""

from __future__ import annotations

import json
import os

import torch
from fake_worker import write_fake_model

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=30,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[1.5 + 0.5 * i for i in range(8)])


def family_config(name: str, **overrides):
    """transformers' config of family `name` (a FAMILIES entry), TINY-sized."""
    import transformers as c

    tiny = {**TINY, **overrides}
    return {
        "qwen3": lambda: c.Qwen3Config(**tiny, rope_theta=1e6, tie_word_embeddings=True),
        "qwen3_window": lambda: c.Qwen3Config(**tiny, use_sliding_window=True, sliding_window=12,
                                              max_window_layers=1),
        "mistral_window": lambda: c.MistralConfig(**tiny, sliding_window=12),
        "phi3_longrope": lambda: c.Phi3Config(**{**tiny, "max_position_embeddings": 160, "hidden_size": 128},
                                              partial_rotary_factor=0.5, rope_scaling=LONGROPE,
                                              original_max_position_embeddings=30, pad_token_id=0),
        "gemma2": lambda: c.Gemma2Config(**tiny, sliding_window=12, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
        "gemma3": lambda: c.Gemma3TextConfig(**tiny, sliding_window=12, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"] * 2,
                                             rope_parameters={
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 1e4}}),
        "llama_yarn": lambda: c.LlamaConfig(**tiny, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        "llama_dynamic": lambda: c.LlamaConfig(**{**tiny, "max_position_embeddings": 40},
                                               rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "mixtral": lambda: c.MixtralConfig(**tiny, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=None),
        "qwen3_moe": lambda: c.Qwen3MoeConfig(**tiny, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=48, norm_topk_prob=True,
                                              mlp_only_layers=[0]),
        "qwen2_moe": lambda: c.Qwen2MoeConfig(**tiny, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                              decoder_sparse_step=2),
    }[name]()


FAMILIES = ["qwen3", "qwen3_window", "mistral_window", "phi3_longrope", "gemma2", "gemma3",
            "llama_yarn", "llama_dynamic", "mixtral", "qwen3_moe", "qwen2_moe"]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations, so a mismatch changes the tokens (HF's init is too small). Gemma
    scales embeddings by sqrt(hidden): smaller ones keep the layers' share of the residual."""
    g = torch.Generator().manual_seed(seed)
    embed = model.config.hidden_size ** -0.5 if "gemma" in model.config.model_type else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(embed * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def make_tiny_family(path: str, name: str, seed: int = 0, max_context: int = 256) -> str:
    """A servable HF directory (config, safetensors, tokenizer) of family `name`."""
    import transformers

    info = write_fake_model(path, max_context=max_context)
    cfg = family_config(name, vocab_size=info["vocab_size"], max_position_embeddings=max_context)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "bos_token_id": 1}, f)
    return path
