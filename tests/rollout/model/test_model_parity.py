"""The engine's own model code against Hugging Face transformers on the same
checkpoints: teacher-forced log-probs of the engine's sampled tokens, greedy
tokens, every family, dtype and checkpoint layout."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import FAMILIES, hf_logprobs, make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(3, 40)), [17]]


def _max_logprob_error(hf, outs) -> float:
    worst = 0.0
    for out in outs:
        for s in out.samples:
            ref = hf_logprobs(hf, out.prompt_token_ids, s.token_ids)
            got = torch.tensor(s.logprobs, dtype=torch.float64)
            worst = max(worst, (ref - got).abs().max().item())
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logprobs_match_transformers(checkpoints, family):
    ck = checkpoints[family]
    engine = make_engine(ck.path)
    params = SamplingParams(n=3, max_tokens=40, ignore_eos=True, seed=7, logprobs_mode="raw")
    outs = engine.generate(PROMPTS, params)
    assert [len(o.samples) for o in outs] == [3, 3, 3]
    assert all(len(s.token_ids) == 40 for o in outs for s in o.samples)
    # The longest sequences (37 + 40 tokens) cross the mistral sliding window (12) and several pages.
    assert _max_logprob_error(ck.hf, outs) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_argmax(checkpoints, family):
    ck = checkpoints[family]
    engine = make_engine(ck.path)
    outs = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=30, ignore_eos=True))
    checked = 0
    for out in outs:
        first, second = out.samples
        assert first.token_ids == second.token_ids  # greedy samples of a group agree
        ids = torch.tensor([out.prompt_token_ids + first.token_ids])
        with torch.no_grad():
            logits = ck.hf(ids).logits[0].double()
        start = len(out.prompt_token_ids) - 1
        for i, token in enumerate(first.token_ids):
            top2 = logits[start + i].topk(2)
            if top2.values[0] - top2.values[1] > 1e-4:
                assert token == int(top2.indices[0]), f"position {i}"
                checked += 1
        ref = torch.log_softmax(logits, -1)[start : start + len(first.token_ids)]
        ref = ref.gather(1, torch.tensor(first.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(first.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert checked > 60


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_low_precision_dtypes_match_transformers_in_that_dtype(qwen2, dtype, tol):
    engine = make_engine(qwen2.path, dtype=dtype)
    outs = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=24, ignore_eos=True, seed=3))
    hf = copy.deepcopy(qwen2.hf).to(dtype)
    errors = []
    for out in outs:
        for s in out.samples:
            ref = hf_logprobs(hf, out.prompt_token_ids, s.token_ids)
            errors.append((ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs())
    err = torch.cat(errors)
    assert err.mean() < tol / 4 and err.max() < tol


def test_sharded_checkpoint_with_index_loads(tmp_path):
    hf = make_checkpoint(tmp_path, "llama", seed=5, shards=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    outs = make_engine(tmp_path).generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=20, seed=1, ignore_eos=True))
    assert _max_logprob_error(hf, outs) < 1e-4


def test_legacy_rope_fields_in_config(tmp_path):
    # Checkpoints written before transformers 5 carry rope_theta / rope_scaling at top level.
    hf = make_checkpoint(tmp_path, "llama", seed=6)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    outs = make_engine(tmp_path).generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=20, seed=1, ignore_eos=True))
    assert _max_logprob_error(hf, outs) < 1e-4


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=10, max_window_layers=1)),
        ("llama", dict(attention_bias=True, head_dim=8, rope_scaling={"rope_type": "linear", "factor": 4.0})),
        ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    ],
)
def test_architecture_variants(tmp_path, family, overrides):
    hf = make_checkpoint(tmp_path, family, seed=8, **overrides)
    outs = make_engine(tmp_path).generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=30, seed=2, ignore_eos=True))
    assert _max_logprob_error(hf, outs) < 1e-4
