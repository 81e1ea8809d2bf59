"""Object store sizing for a local Ray start: computed from the checkpoint's
safetensors headers before Ray starts, capped by the machine, overridden by
the user's `ray_init_kwargs`. Nothing here starts Ray."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rollout.cluster import ray_runtime
from rollout.cluster.ray_runtime import connect, local_store_kwargs, store_bytes, weights_bytes

MiB, GiB = 2**20, 2**30


@pytest.fixture
def checkpoint(tmp_path):
    """Two shards: 200 bf16 + 5 float32 elements; 3 int64 ones and a tied lm_head, which a push never sends."""
    save_file(
        {"a.weight": torch.zeros(10, 20, dtype=torch.bfloat16), "b.bias": torch.zeros(5)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"c.ids": torch.zeros(3, dtype=torch.int64), "lm_head.weight": torch.zeros(10, 20, dtype=torch.bfloat16)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return tmp_path


def test_weights_bytes_casts_floating_tensors_to_the_engine_dtype(checkpoint):
    assert weights_bytes(checkpoint, "float32") == 200 * 4 + 5 * 4
    assert weights_bytes(checkpoint, "bfloat16") == 200 * 2 + 5 * 2
    assert weights_bytes(checkpoint, torch.float16) == 200 * 2 + 5 * 2


def test_weights_bytes_counts_an_untied_lm_head(checkpoint):
    (checkpoint / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert weights_bytes(checkpoint, "float32") == 2 * 200 * 4 + 5 * 4


def test_weights_bytes_is_none_without_local_safetensors(tmp_path):
    assert weights_bytes(tmp_path / "missing", "float32") is None
    assert weights_bytes(tmp_path, "float32") is None
    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    assert weights_bytes(tmp_path, "not-a-dtype") is None  # the engine reports a bad dtype itself


def test_store_bytes_two_versions_plus_headroom():
    roomy = 1024 * GiB
    assert store_bytes(1 * GiB, roomy, None) == 2 * GiB + 512 * MiB  # headroom: half a version
    assert store_bytes(100 * MiB, roomy, 1024 * GiB) == 200 * MiB + 256 * MiB  # at least 256 MiB of headroom


def test_store_bytes_caps_and_minimum():
    assert store_bytes(1 * GiB, 4 * GiB, None) == int(4 * GiB * 0.3)  # Ray's default share of available memory
    assert store_bytes(1 * GiB, 1024 * GiB, 1 * GiB) == int(1 * GiB * 0.95)  # /dev/shm's free space
    assert store_bytes(1 * GiB, 100 * MiB, None) == 75 * MiB  # never below Ray's minimum


@pytest.fixture
def machine(monkeypatch):
    monkeypatch.setattr(ray_runtime, "_memory_available", lambda: 1024 * GiB)
    monkeypatch.setattr(ray_runtime, "_shm_free", lambda: None)
    monkeypatch.delenv("RAY_preallocate_plasma_memory", raising=False)


def test_local_store_kwargs_sizes_and_preallocates(checkpoint, machine):
    kwargs = local_store_kwargs({"num_cpus": 2}, checkpoint, "float32")
    assert kwargs == {
        "num_cpus": 2,
        "object_store_memory": 2 * 820 + 256 * MiB,
        "_system_config": {"preallocate_plasma_memory": True},
    }


def test_user_kwargs_win(checkpoint, machine, monkeypatch):
    mine = {"object_store_memory": 3 * GiB}
    assert local_store_kwargs(mine, checkpoint, "float32") == mine  # their store, left as Ray makes it
    theirs = local_store_kwargs({"_system_config": {"preallocate_plasma_memory": False, "x": 1}}, checkpoint)
    assert theirs["_system_config"] == {"preallocate_plasma_memory": False, "x": 1}
    assert theirs["object_store_memory"] == 2 * 820 + 256 * MiB
    monkeypatch.setenv("RAY_preallocate_plasma_memory", "0")
    assert "_system_config" not in local_store_kwargs({}, checkpoint)
    assert local_store_kwargs({}, checkpoint / "elsewhere") == {}  # not readable here: Ray's defaults


class FakeRay:
    def __init__(self):
        self.calls = []

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        self.calls.append(kwargs)


@pytest.mark.parametrize("address", [None, "local"])
def test_connect_sizes_a_local_start(checkpoint, machine, monkeypatch, address):
    fake = FakeRay()
    monkeypatch.setattr(ray_runtime, "ray_module", lambda: fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert connect(address, {"log_to_driver": False}, checkpoint, "bfloat16")
    (call,) = fake.calls
    assert call["address"] == "local" and call["log_to_driver"] is False
    assert call["object_store_memory"] == 2 * 410 + 256 * MiB
    assert call["_system_config"] == {"preallocate_plasma_memory": True}


def test_connect_leaves_a_joined_cluster_alone(checkpoint, machine, monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(ray_runtime, "ray_module", lambda: fake)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    connect(None, None, checkpoint)
    connect("auto", None, checkpoint)
    assert [c["address"] for c in fake.calls] == ["10.0.0.1:6379", "auto"]
    assert not any("object_store_memory" in c for c in fake.calls)
