"""Every model shape the benchmarks, checks, the demo and the tests build, as
named Hugging Face config dicts (`model_type` included, so
`transformers.AutoConfig.for_model(**preset(name))` builds the config, and a
dict dumped as config.json is a checkpoint's config).

Each dict holds only the fields its users set; everything else is the
config class's default (transformers) or the engine's (rollout/model/config.py).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Real models' shapes.
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "smollm2-135m": dict(  # SmolLM2-135M-Instruct
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    # The `bench-25m` workload's model (scripts/bench.py, docs/benchmarks.md).
    "bench-25m": dict(
        model_type="qwen2",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
    # The mixture-of-experts benchmark's model (scripts/bench_moe.py): a small Qwen3-MoE shape,
    # 8 layers of 16 experts (top 4, renormalised, each 192 wide), hidden 512.
    "bench-moe": dict(
        model_type="qwen3_moe",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        moe_intermediate_size=192,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
    # The weight-sync benchmark's model (scripts/bench_sync.py): a 485 MiB float32 state dict.
    "bench-sync": dict(
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        eos_token_id=2,
    ),
    # scripts/gpu_check.py's bf16 parity and CUDA-graph check.
    "gpu-parity": dict(
        model_type="qwen2",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    # scripts/gpu_check.py --smoke: every section on the CPU in seconds.
    "smoke": dict(
        model_type="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    # scripts/soak.py's model: small enough that many callers and pushes fit in a short run.
    "soak": dict(
        model_type="qwen2",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=2,
    ),
    # The GRPO demo's policy (examples/grpo_demo/task.py): 16 tokens, prompts and answers of a few tokens.
    "grpo-demo": dict(
        model_type="llama",
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The GRPO demo's mixture-of-experts model (`--model moe`): 8 experts of which 2 route each token.
    "grpo-demo-moe": dict(
        model_type="qwen3_moe",
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The tests' checkpoints (tests/factories.py), here as qwen2; the factory
    # sets each family's type, tying, head size and rope per family.
    "test-tiny": dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=1,
    ),
}


def preset(name: str, **overrides) -> dict:
    """A fresh copy of the named config dict with `overrides` applied."""
    if name not in PRESETS:
        raise KeyError(f"no model preset {name!r}; one of {', '.join(PRESETS)}")
    return {**PRESETS[name], **overrides}
