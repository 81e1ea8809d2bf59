"""Small factories for tests: tiny random checkpoints written by transformers
(the reference) and a tiny tokenizer built with the tokenizers library."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch

from scripts.presets import preset

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")

# Per family, over the `test-tiny` preset (scripts/presets.py): the features the engine must cover.
_FAMILY = {
    "llama": dict(
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(
        tie_word_embeddings=True, head_dim=24, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "mistral": dict(tie_word_embeddings=False, head_dim=32, sliding_window=12, rope_theta=10000.0),
    # Layer 1 dense between sparse ones; top-2 of 8 without renormalising (mixtral always renormalises).
    "qwen3_moe": dict(
        tie_word_embeddings=True,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        rope_theta=10000.0,
    ),
    "mixtral": dict(
        tie_word_embeddings=False,
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=48,
        sliding_window=12,
        rope_theta=10000.0,
    ),
}


def hf_config(family: str, **overrides):
    from transformers import AutoConfig

    kwargs = preset("test-tiny", **{**_FAMILY[family], **overrides})
    del kwargs["model_type"]
    rope_theta = kwargs.pop("rope_theta", 10000.0)
    rope_scaling = kwargs.pop("rope_scaling", None)
    cfg = AutoConfig.for_model(family, **kwargs)
    params = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        params.update(rope_scaling)
    cfg.rope_parameters = params
    return cfg


def make_checkpoint(
    path: Path,
    family: str = "qwen2",
    seed: int = 0,
    dtype=torch.float32,
    shards: bool = False,
    tokenizer: bool = False,
    **overrides,
):
    """Write a random tiny `family` model to `path`; returns the transformers model (eval, float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    max_shard = "20KB" if shards else "10GB"
    model.to(dtype).save_pretrained(path, safe_serialization=True, max_shard_size=max_shard)
    model.float()
    if tokenizer:
        write_tokenizer(path)
    return model


def _randomize(model, seed: int) -> None:
    # The default init leaves norms at 1 and biases at 0; perturb everything so
    # every tensor (norm weights, biases) influences the output.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def write_tokenizer(path: Path, vocab_size: int = 96, extra: str = "") -> None:
    """A byte-level-ish character tokenizer: ids 0..3 special, then characters from
    chr(32) on, then the characters of `extra` (vocab_size counts them all)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(c) for c in range(32, 32 + vocab_size - len(specials) - len(extra))] + list(extra)
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    for s in specials:
        tok.add_special_tokens([s])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Teacher-forced log p(tokens[i] | prompt + tokens[:i]) under `model` (float64 log_softmax)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return lp[start : start + len(tokens)].gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def pack_state(state_dict, bucket_bytes: int | None = None):
    """`state_dict` packed as the weight wire format's buckets, each copied
    together from its segments, and their manifest: what an actor holds once
    a push has arrived, without an object store in between."""
    import numpy as np

    from rollout.cluster.wire import Manifest
    from rollout.cluster.wire_send import DEFAULT_BUCKET_BYTES, BucketPacker

    buckets, entries = [], []
    for packed in BucketPacker(bucket_bytes or DEFAULT_BUCKET_BYTES).pack_buckets(state_dict):
        buckets.append(np.concatenate(packed.segments))
        entries.extend(packed.entries)
    return buckets, Manifest(tuple(entries), tuple(b.nbytes for b in buckets))


def with_pushes(model, *states):
    """A copy of `model` with each state dict, whole or partial, copied in
    order: the weights an engine serves after those pushes. Names that share
    a parameter (a tied `lm_head.weight`) write it through either name."""
    import copy

    out = copy.deepcopy(model)
    live = out.state_dict()
    with torch.no_grad():
        for state in states:
            for name, tensor in state.items():
                live[name].copy_(tensor)
    return out


def fail_launch(engine, monkeypatch, at: int) -> None:
    """Make the engine's `at`-th step launch from now on raise `RuntimeError("device fell over")`."""
    real, calls = engine.stepper.launch, {"n": 0}

    def flaky(plan, staged=False):
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError("device fell over")
        return real(plan, staged)

    monkeypatch.setattr(engine.stepper, "launch", flaky)


class CountingOps:
    """The compiled ops namespace, counting which ops the model looks up."""

    def __init__(self, ops):
        self.ops, self.calls = ops, collections.Counter()

    def __getattr__(self, name):
        self.calls[name] += 1
        return getattr(self.ops, name)
