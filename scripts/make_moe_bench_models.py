"""Write two random-weight bf16-servable models for `pdserve bench engine`: a dense Qwen3 and
a Qwen3-MoE with the same active MLP width (docs/benchmarks.md, "A tiny MoE beside a dense
model"). Usage: python scripts/make_moe_bench_models.py [OUT_DIR] (default /tmp/bench_models)."""

from __future__ import annotations

import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness.fake_worker import write_fake_model  # noqa: E402
from tests.harness.tiny_families import randomize  # noqa: E402

COMMON = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
MODELS = {
    "dense": lambda v: transformers.Qwen3Config(vocab_size=v, intermediate_size=512, **COMMON),
    "moe": lambda v: transformers.Qwen3MoeConfig(vocab_size=v, intermediate_size=512, moe_intermediate_size=256,
                                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                                 **COMMON),
}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_models"
    for name, make in MODELS.items():
        path = os.path.join(out, name)
        info = write_fake_model(path, max_context=4096)
        model = transformers.AutoModelForCausalLM.from_config(make(info["vocab_size"]), dtype=torch.float32)
        randomize(model, 0)
        model.save_pretrained(path)
        print(path, sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main()
