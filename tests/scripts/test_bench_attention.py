"""scripts/bench_attention.py: the bytes it divides by are every key and value
the kernel must read (figures never asserted)."""

from __future__ import annotations

import torch

from scripts import bench_attention
from scripts.presets import preset


def test_bytes_are_every_rows_context_keys_and_values_once_per_layer():
    config = preset("soak")
    seconds, nbytes = bench_attention.time_attention(
        config, rows=3, context=21, dtype=torch.bfloat16, sequential=False, runs=1
    )
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    expected = config["num_hidden_layers"] * 3 * 21 * config["num_key_value_heads"] * head_dim * 2 * 2
    assert nbytes == expected and seconds > 0
