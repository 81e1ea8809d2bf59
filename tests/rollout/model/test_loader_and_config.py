"""Checkpoint and config errors: every one is a clear ValueError naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout.model.config import ModelConfig
from tests.conftest import make_engine


@pytest.fixture
def ckpt(tmp_path, qwen2):
    path = tmp_path / "ck"
    shutil.copytree(qwen2.path, path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        make_engine(tmp_path / "absent")
    with pytest.raises(ValueError, match="no config.json"):
        make_engine(tmp_path)


def test_malformed_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        make_engine(ckpt)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        make_engine(ckpt)


@pytest.mark.parametrize(
    "changes,needle",
    [
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (dict(model_type=None), "model_type None is not supported"),
        (dict(hidden_size=-4), "hidden_size must be an integer in 1..65536"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope type 'yarn'"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_unsupported_or_invalid_config_fields(ckpt, changes, needle):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=needle):
        make_engine(ckpt)


def test_missing_tensor_is_named(ckpt):
    _edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.weight"):
        make_engine(ckpt)


def test_shape_disagreeing_with_config_is_named(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.v_proj.weight"] = t["model.layers.0.self_attn.v_proj.weight"][:-1].clone()

    _edit_weights(ckpt, shrink)
    with pytest.raises(ValueError, match=r"v_proj\.weight' has shape \(31, 64\), the config implies \(32, 64\)"):
        make_engine(ckpt)


def test_unknown_tensor_is_named(ckpt):
    _edit_weights(ckpt, lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="model.extra.weight"):
        make_engine(ckpt)


def test_pickle_weights_are_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle-based weights .*pytorch_model.bin.*nothing is unpickled"):
        make_engine(ckpt)


def test_no_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weight files"):
        make_engine(ckpt)


def test_corrupt_safetensors_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        make_engine(ckpt)


def test_config_parsing_of_families(checkpoints):
    q3 = ModelConfig.from_dir(checkpoints["qwen3"].path)
    assert (q3.head_dim, q3.qk_norm, q3.tie_word_embeddings, q3.rope.type) == (24, True, True, "linear")
    mi = ModelConfig.from_dir(checkpoints["mistral"].path)
    assert mi.sliding_windows == (12, 12) and not mi.attention_bias
    q2 = ModelConfig.from_dir(checkpoints["qwen2"].path)
    assert q2.attention_bias and not q2.o_bias and q2.sliding_windows == (None, None)
    ll = ModelConfig.from_dir(checkpoints["llama"].path)
    assert ll.rope.type == "llama3" and ll.rope.original_max_position_embeddings == 64
    assert ll.eos_token_ids == (2,)


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        (dict(device="tpu"), ValueError, "device"),
        (dict(device=3), TypeError, "device"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (dict(dtype=torch.int32), ValueError, "dtype"),
        (dict(max_batch_size=0), ValueError, "max_batch_size"),
        (dict(max_batch_size=2.0), TypeError, "max_batch_size"),
        (dict(max_seq_len=10_000), ValueError, "max_position_embeddings"),
        (dict(kv_cache_tokens=3), ValueError, "kv_cache_tokens"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(max_step_tokens=4), ValueError, "max_step_tokens"),
    ],
)
def test_engine_arguments_are_validated(qwen2, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        make_engine(qwen2.path, **kwargs)
