"""A sharded checkpoint's index is data: every file it names must lie inside
the checkpoint directory, whatever `..` or absolute paths say; symlinks the
directory holds are followed (Hugging Face's cache is made of them)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rollout.model.loader import checkpoint_files
from tests.conftest import make_engine

INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tmp_path, qwen2):
    """A copy of the qwen2 checkpoint inside `tmp_path/ck`, and next to it
    (outside) `tmp_path/x.safetensors`, a valid copy of its weights: an
    escaping index entry would load without any other error."""
    path = tmp_path / "ck"
    shutil.copytree(qwen2.path, path)
    shutil.copy(path / "model.safetensors", tmp_path / "x.safetensors")
    return path


def _write_index(path, shard: str) -> None:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (path / "model.safetensors").unlink()
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[0]] = shard  # one entry is enough to read a file
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _assert_loads_the_weights(ckpt, original) -> None:
    """An engine on `ckpt` holds exactly the weights of the checkpoint it was copied from."""
    slots = make_engine(ckpt, max_batch_size=2, max_seq_len=32, kv_cache_tokens=256).model.weight_slots()
    for name, tensor in original.hf.state_dict().items():
        assert torch.equal(slots[name].view(), tensor.to(slots[name].view().dtype)), name


def test_an_index_inside_the_directory_loads(ckpt, qwen2):
    shutil.copy(ckpt / "model.safetensors", ckpt / "shard.safetensors")
    _write_index(ckpt, "shard.safetensors")
    (ckpt / "model.safetensors").symlink_to("shard.safetensors")  # a link that stays inside is fine
    assert [f.name for f in checkpoint_files(ckpt)] == ["model.safetensors", "shard.safetensors"]
    _assert_loads_the_weights(ckpt, qwen2)


def test_a_snapshot_of_links_into_a_blob_store_loads(ckpt, qwen2):
    """Hugging Face's cache: snapshots/<rev>/ holds links to ../../blobs/<hash>."""
    blobs = ckpt.parent / "blobs"
    blobs.mkdir()
    shutil.copy(ckpt / "model.safetensors", blobs / "0123abcd")
    _write_index(ckpt, "shard.safetensors")
    for name in ("model.safetensors", "shard.safetensors"):
        (ckpt / name).symlink_to("../blobs/0123abcd")
    assert [f.name for f in checkpoint_files(ckpt)] == ["model.safetensors", "shard.safetensors"]
    _assert_loads_the_weights(ckpt, qwen2)


@pytest.mark.parametrize("escape", ["parent", "absolute", "inner_parent"])
def test_an_index_entry_outside_the_directory_is_refused(ckpt, escape):
    outside = ckpt.parent / "x.safetensors"
    shard = {"parent": "../x.safetensors", "absolute": str(outside), "inner_parent": "sub/../../x.safetensors"}[escape]
    (ckpt / "sub").mkdir()
    _write_index(ckpt, shard)
    (ckpt / "model.safetensors").write_bytes((ckpt.parent / "x.safetensors").read_bytes())
    needle = rf"{INDEX} weight_map\['.+'\] names '{shard}', which lies outside the checkpoint directory"
    with pytest.raises(ValueError, match=needle):
        checkpoint_files(ckpt)
    with pytest.raises(ValueError, match=needle):
        make_engine(ckpt, max_batch_size=2, max_seq_len=32, kv_cache_tokens=256)


@pytest.mark.parametrize("weight_map", [["a"], {"w": 3}, {"w": ""}])
def test_a_malformed_index_is_named(ckpt, weight_map):
    (ckpt / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=INDEX):
        checkpoint_files(ckpt)
