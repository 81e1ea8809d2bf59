"""The demo's task, "copying with a rule": the prompt is a digit and ">",
e.g. "4>"; the answer is four tokens, and the reward is the fraction of them
that equal the digit's successor (mod 10), "5555" for "4>". A random model
scores about 1/16; GRPO lifts it within a few dozen steps.

Here: the tokenizer (one token per symbol), the tiny Llama checkpoint (the
`grpo-demo` preset of scripts/presets.py), the prompts and the reward.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from scripts.presets import preset

SPECIALS = ["<pad>", "<s>", "</s>"]
SYMBOLS = [str(d) for d in range(10)] + [">", "+", "="]
ANSWER_TOKENS = 4


def make_task_model(path: Path, seed: int, symbols: list[str] = SYMBOLS, shape: str = "grpo-demo"):
    """Write a random tiny checkpoint of the preset `shape` (a Llama, or `grpo-demo-moe`:
    a Qwen3-MoE) and its tokenizer (one token per symbol of `symbols`) to `path`;
    return the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**preset(shape)))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, symbols)
    return model


def write_tokenizer(path: Path, symbols: list[str] = SYMBOLS) -> None:
    """A word-level tokenizer with one token per symbol, `<s>` put in front of every prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + symbols)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))


def prompts(rng: random.Random, count: int) -> list[str]:
    """`count` random prompts: a digit and ">"."""
    return [f"{rng.randrange(10)}>" for _ in range(count)]


def rewards(prompts: list[str], batch) -> torch.Tensor:
    """Fraction of each row's answer tokens that are the successor of its prompt digit."""
    target = torch.tensor([(int(prompts[g][0]) + 1) % 10 + len(SPECIALS) for g in batch.group_index.tolist()])
    hits = (batch.response_ids == target[:, None]) & batch.response_mask.bool()
    return hits.float().sum(dim=1) / ANSWER_TOKENS
