"""`scripts/launch_cluster.sh --model`: the object store options it hands
`ray start`, checked against a stand-in `ray` that prints them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout.cluster.ray_runtime import local_store_bytes

ROOT = Path(__file__).resolve().parents[2]

FAKE_RAY = """#!/usr/bin/env bash
echo "ARGS $*"
echo "PREALLOCATE ${RAY_preallocate_plasma_memory:-unset}"
"""


@pytest.fixture
def launch(tmp_path):
    fake = tmp_path / "ray"
    fake.write_text(FAKE_RAY)
    fake.chmod(0o755)
    env = {**os.environ, "RAY": str(fake), "PYTHON": sys.executable}
    env.pop("RAY_preallocate_plasma_memory", None)

    def run(*args: str, **extra_env: str) -> tuple[list[str], str]:
        done = subprocess.run(
            [str(ROOT / "scripts" / "launch_cluster.sh"), *args],
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
        return lines["ARGS"].split(), lines["PREALLOCATE"]

    return run


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    save_file({"w": torch.zeros(1000, 100, dtype=torch.bfloat16)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({}))
    return path


def test_model_sizes_and_preallocates_the_store(launch, checkpoint):
    args, prealloc = launch("head", "--port", "6390", "--model", str(checkpoint), "--dtype", "bfloat16")
    i = args.index("--object-store-memory")
    assert int(args[i + 1]) == local_store_bytes(checkpoint, "bfloat16")
    assert "--model" not in args and "--dtype" not in args and "--port" in args
    assert prealloc == "1"


def test_users_store_size_wins(launch, checkpoint):
    args, prealloc = launch("worker", "--address", "h:1", "--model", str(checkpoint), "--object-store-memory", "99")
    assert args.count("--object-store-memory") == 1 and args[args.index("--object-store-memory") + 1] == "99"
    assert prealloc == "1"
    _, prealloc = launch("head", "--object-store-memory=99", RAY_preallocate_plasma_memory="0")
    assert prealloc == "0"


def test_without_model_the_store_is_rays(launch):
    args, prealloc = launch("head", "--port", "6390")
    assert "--object-store-memory" not in args and prealloc == "unset"
