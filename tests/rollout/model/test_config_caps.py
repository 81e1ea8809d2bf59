"""config.json sizes have upper bounds, checked as the config is parsed: the
largest public models are accepted, anything above a cap is refused with a
message naming the field and the cap, before anything is allocated."""

from __future__ import annotations

import json
import shutil

import pytest

import rollout.engine.engine as engine_module
from rollout.model.config import MAX_KV_ELEMENTS_PER_TOKEN, MAX_ROTARY_ELEMENTS, MAX_SIZES, ModelConfig
from tests.conftest import make_engine

# The published config.json of Llama-3.1-405B and of Qwen2.5-72B (sizes and rope as released).
LLAMA_405B = {
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "eos_token_id": [128001, 128008, 128009],
}
QWEN_72B = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "max_window_layers": 70,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "eos_token_id": 151643,
}
# A small config every edge case starts from: each field far below its cap.
SMALL = {
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 96,
    "max_position_embeddings": 128,
}


def test_the_largest_public_configs_are_accepted():
    big = ModelConfig.from_dict(LLAMA_405B)
    assert (big.head_dim, big.num_layers, big.q_size, big.kv_size) == (128, 126, 16384, 1024)
    assert (big.rope.factor, big.rope.original_max_position_embeddings) == (8.0, 8192)
    qwen = ModelConfig.from_dict(QWEN_72B)
    assert (qwen.head_dim, qwen.intermediate_size, qwen.sliding_windows) == (128, 29568, (None,) * 80)
    # Llama 4 Scout's ten-million-token context, in a family served here.
    scout = ModelConfig.from_dict(LLAMA_405B | {"max_position_embeddings": 10_485_760})
    assert scout.max_position_embeddings == 10_485_760


_ATTRS = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
}  # ModelConfig's names
# Fields set together so that only the one under test reaches its cap.
_AT_CAP = {
    "vocab_size": {},
    "hidden_size": {},
    "intermediate_size": {},
    "num_hidden_layers": {},
    "num_attention_heads": {},
    "num_key_value_heads": {"num_attention_heads": MAX_SIZES["num_key_value_heads"]},
    "head_dim": {},
    "max_position_embeddings": {},
    "sliding_window": {},
}


@pytest.mark.parametrize("field", sorted(_AT_CAP))
def test_each_size_is_accepted_at_its_cap_and_refused_above(field):
    cap = MAX_SIZES[field]
    at_cap = SMALL | _AT_CAP[field] | {field: cap}
    parsed = ModelConfig.from_dict(at_cap)
    read = parsed.sliding_windows[0] if field == "sliding_window" else getattr(parsed, _ATTRS.get(field, field))
    assert read == cap
    with pytest.raises(ValueError, match=rf"config.json {field} must be an integer in 1\.\.{cap}, got {cap + 1}"):
        ModelConfig.from_dict(at_cap | {field: cap + 1})


@pytest.mark.parametrize(
    "rope", [{"rope_type": "linear"}, {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}]
)
def test_rope_factor_is_capped(rope):
    assert ModelConfig.from_dict(SMALL | {"rope_scaling": rope | {"factor": 1024.0}}).rope.factor == 1024.0
    with pytest.raises(ValueError, match=r"config.json factor must be a finite number in \[1.0, 1024.0\], got 1025.0"):
        ModelConfig.from_dict(SMALL | {"rope_scaling": rope | {"factor": 1025.0}})


def test_derived_rotary_and_kv_sizes_are_bounded_at_parse():
    positions = MAX_SIZES["max_position_embeddings"]
    edge = SMALL | {"max_position_embeddings": positions, "head_dim": MAX_ROTARY_ELEMENTS // positions}
    assert ModelConfig.from_dict(edge).head_dim == 256  # 2**24 positions x 256 = 2**32 elements: the edge
    with pytest.raises(ValueError, match=r"max_position_embeddings x head_dim \(the rotary table\) is 4328521728"):
        ModelConfig.from_dict(edge | {"head_dim": 258})
    kv = SMALL | {"num_hidden_layers": 1024, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128}
    assert 2 * 1024 * 64 * 128 == MAX_KV_ELEMENTS_PER_TOKEN
    ModelConfig.from_dict(kv)
    with pytest.raises(ValueError, match=r"num_key_value_heads x head_dim \(the KV of one token\) is 17039360"):
        ModelConfig.from_dict(kv | {"head_dim": 130})


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"head_dim": 15}, "head_dim must be even"),
        ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be a finite number in \[0.0, 1.0\]"),
        ({"rope_theta": float("inf")}, r"rope_theta must be a finite number in \(0.0, inf\]"),
        ({"rope_scaling": [2.0]}, "rope_parameters \\(or rope_scaling\\) must be an object"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor must be a finite number"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
            r"high_freq_factor must be a finite number in \(4.0, 1024.0\]",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 2**24 + 1,
                }
            },
            r"original_max_position_embeddings must be an integer in 1\.\.16777216",
        ),
    ],
)
def test_bad_rope_and_norm_fields_are_named(changes, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict(SMALL | changes)


def test_a_huge_context_is_refused_before_anything_is_built(tmp_path, qwen2, monkeypatch):
    path = tmp_path / "ck"
    shutil.copytree(qwen2.path, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 2**24 + 1}))

    def no_model(*args, **kwargs):
        raise AssertionError("a model (its rotary table, its weights) was built from a refused config")

    monkeypatch.setattr(engine_module, "Model", no_model)
    with pytest.raises(ValueError, match=r"max_position_embeddings must be an integer in 1\.\.16777216"):
        make_engine(path, max_seq_len=None, kv_cache_tokens=256)
