"""Checkpoint loading: Hugging Face safetensors (single file or sharded with
an index), copied tensor by tensor straight into the live parameters.

Checkpoints are data, never code: only safetensors are read; pickle-based
weight files are refused, nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from .decoder import Model
from .weight_slots import WeightSlot

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Non-persistent buffers some older checkpoints carry; recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_files(path, index)
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"checkpoint {str(path)!r} has only pickle-based weights ({', '.join(pickles)}); "
            "weights load only from safetensors, nothing is unpickled"
        )
    raise ValueError(f"checkpoint {str(path)!r} has no *.safetensors weight files")


def _indexed_files(path: Path, index: Path) -> list[Path]:
    """The shard files `index` names, each confined to `path`: an index is
    data, and an entry like `../x.safetensors` or an absolute path would read
    weights from anywhere on the host. The names are confined as written; a
    symlink the directory itself holds is the directory owner's choice, and
    Hugging Face's cache lays out every snapshot as links into its blob store."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        entries = weight_map.items()
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index.name} in {str(path)!r} is malformed: {e!r}") from None
    root = Path(os.path.abspath(path))
    files = set()
    for tensor, name in entries:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{index.name} weight_map[{tensor!r}] must be a file name, got {name!r}")
        if not Path(os.path.abspath(root / name)).is_relative_to(root):  # `..` folded, links kept
            raise ValueError(
                f"{index.name} weight_map[{tensor!r}] names {name!r}, which lies outside the checkpoint "
                f"directory {str(path)!r}; shard files must be inside it"
            )
        files.add(path / name)
    missing = [f.name for f in sorted(files) if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is missing shard files: {', '.join(missing)}")
    return sorted(files)


def load_checkpoint(model: Model, path: str | Path) -> None:
    """Copy every checkpoint tensor into its slot of `model`.

    Raises `ValueError` naming the tensor on an unknown name, a shape that
    disagrees with the config, or a tensor the model needs that is missing.
    """
    slots = model.weight_slots()
    covered: dict[str, torch.Tensor] = {}  # parameter name -> which of its rows the checkpoint set
    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{file.name} is not a readable safetensors file: {e}") from None
        with handle as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the head, as in the reference
                slot = slots.get(name)
                if slot is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} in {file.name} is not a parameter of a "
                        f"{model.cfg.model_type} model with this config.json"
                    )
                _copy_into(slot, name, f.get_tensor(name))
                rows = covered.setdefault(slot.param_name, torch.zeros(slot.param.shape[0], dtype=torch.bool))
                rows[slot.start : slot.start + slot.rows] = True
    # A tensor is there when its rows are, under any of the names that hold them
    # (experts one by one or fused, a router under either family's name).
    missing = [name for name, slot in slots.items() if not _covered(covered, slot)]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {str(path)!r} is missing tensors: {shown}")


def _covered(covered: dict[str, torch.Tensor], slot: WeightSlot) -> bool:
    rows = covered.get(slot.param_name)
    return rows is not None and bool(rows[slot.start : slot.start + slot.rows].all())


def _copy_into(slot: WeightSlot, name: str, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != slot.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {slot.shape}")
    if not tensor.is_floating_point():
        raise ValueError(f"checkpoint tensor {name!r} has dtype {tensor.dtype}, expected a floating-point dtype")
    slot.view().copy_(tensor)
