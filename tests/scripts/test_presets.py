"""scripts/presets.py: every named shape is a config transformers and the
engine both read, with the sizes its users rely on."""

from __future__ import annotations

import math

import pytest

from rollout.model.config import ModelConfig
from scripts.bench import dense_params
from scripts.presets import PRESETS, preset
from scripts.synthetic import qwen2_config, qwen2_shapes


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_a_config_transformers_and_the_engine_read(name):
    from transformers import AutoConfig

    cfg = preset(name)
    hf = AutoConfig.for_model(**cfg)
    assert hf.model_type == cfg["model_type"]
    for key, value in cfg.items():
        if key != "rope_theta":  # transformers >= 5 keeps it in rope_parameters
            assert getattr(hf, key) == value, key
    engine = ModelConfig.from_dict(cfg)
    assert (engine.vocab_size, engine.hidden_size, engine.num_layers) == (
        cfg["vocab_size"],
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
    )
    assert engine.tie_word_embeddings == cfg["tie_word_embeddings"]


def test_smollm2_135m_shape():
    cfg = preset("smollm2-135m")
    # 30 layers of q (576 x 576), k and v (3 heads of 64 = 192 rows each), o (576 x 576) and
    # the MLP (3 x 576 x 1536): 30 * 3538944 = 106168320, plus the tied 49152 x 576 embedding
    # 28311552: 134479872, "135M" with the norms.
    assert dense_params(cfg) == 134479872
    engine = ModelConfig.from_dict(cfg)
    assert engine.head_dim == 64 and engine.rope.theta == 100000.0 and engine.rms_norm_eps == 1e-5


def test_gpu_shapes_have_the_published_parameter_counts():
    """Multiplied parameters (scripts/bench.py's dense_params) plus the rest each model's
    card counts: Qwen2.5-1.5B 1,543,714,304 (tied: q/k/v biases and RMSNorm weights on top),
    Llama-3-8B 8,030,261,248 (untied: the input embedding and the norms on top)."""
    qwen = preset("qwen2.5-1.5b")
    biases = qwen["num_hidden_layers"] * (1536 + 2 * 256)
    norms = (2 * qwen["num_hidden_layers"] + 1) * qwen["hidden_size"]
    assert dense_params(qwen) + biases + norms == 1_543_714_304
    llama = preset("llama-3-8b")
    embedding = llama["vocab_size"] * llama["hidden_size"]
    norms = (2 * llama["num_hidden_layers"] + 1) * llama["hidden_size"]
    assert dense_params(llama) + embedding + norms == 8_030_261_248


def test_bench_sync_pushes_485_mib():
    shapes = qwen2_shapes(qwen2_config("bench-sync"))
    assert round(4 * sum(math.prod(s) for s in shapes.values()) / 2**20) == 485


def test_preset_is_a_fresh_copy_with_overrides():
    a = preset("smoke", vocab_size=300)
    a["hidden_size"] = 1
    assert a["vocab_size"] == 300 and preset("smoke")["hidden_size"] == 64
    with pytest.raises(KeyError, match="no model preset 'nope'"):
        preset("nope")


def test_synthetic_checkpoints_take_tied_qwen2_presets_only():
    assert qwen2_config("soak")["vocab_size"] == 512
    with pytest.raises(ValueError, match="tied Qwen2"):
        qwen2_config("grpo-demo")
