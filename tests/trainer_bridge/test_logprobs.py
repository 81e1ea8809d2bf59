"""`token_logprobs` at the top-p edge: every token the compiled sampler draws
gets a finite recompute, equal to the engine's logprob on the engine's logits."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from rollout import RolloutOutput, Sample, SamplingParams
from rollout.engine.sampler import MODE_CODES
from rollout.kernels.build import cpu_ops
from tests.reference import top_p_edge_rows
from trainer_bridge import RolloutBatch, token_logprobs


class FixedLogits(nn.Module):
    """A model whose logits are given: `[B, 2, V]` for one prompt token and one response token."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask, position_ids):
        assert input_ids.shape == self.logits.shape[:2]
        return SimpleNamespace(logits=self.logits)


def _engine_draws(logits, temperature, top_p, u):
    """The compiled sampler's tokens and processed logprobs, one per row of `logits` `[B, V]`."""
    rows = logits.shape[0]
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    top_k, min_p = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows)
    mode = torch.full((rows,), MODE_CODES["processed"])
    cpu_ops().sample_rows(logits, temperature, top_k, top_p, min_p, mode, u, tokens, logprobs)
    return tokens, logprobs


def _batch(tokens, logprobs, temperature, top_p):
    """One sample per row: prompt token 0, then the drawn token; per-row settings."""
    outputs = [
        RolloutOutput([0], [Sample([t], [lp], [0], "length")], index=i)
        for i, (t, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True))
    ]
    batch = RolloutBatch.from_outputs(outputs, SamplingParams(top_p=0.5), policy_version=0)
    batch.temperature, batch.top_p = temperature.clone(), top_p.clone()
    return batch


def _model(response_logits):
    """Logits `[B, 2, V]` whose first position predicts the response token."""
    return FixedLogits(torch.stack([response_logits, torch.zeros_like(response_logits)], dim=1))


def test_a_token_the_engine_draws_where_float32_sums_end_top_p_scores_finite():
    """Ten logits 2**-30 apart weigh 1 each; top_p float32(0.1) is above the exact tenth
    before token 1, so the engine keeps tokens 0 and 1 and draws token 1 at u = 0.99. A
    float32 cumulative sum rounds that tenth onto top_p and drops token 1 (-inf)."""
    logits = (-torch.arange(10, dtype=torch.float32) * 2**-30)[None]
    temperature, top_p = torch.ones(1), torch.full((1,), 0.1)
    tokens, logprobs = _engine_draws(logits, temperature, top_p, torch.tensor([0.99]))
    assert tokens.tolist() == [1]
    batch = _batch(tokens, logprobs, temperature, top_p)
    recomputed = token_logprobs(_model(logits), batch)
    torch.testing.assert_close(recomputed, logprobs[:, None], rtol=0, atol=1e-6)
    assert batch.mismatch["max_abs"] < 1e-6


def test_every_token_drawn_at_the_top_p_edge_recomputes_finite():
    """On the engine's logits the recompute is the engine's logprob (the compiled exp and
    torch's may differ in a last bit in a rare row); on a trainer's slightly different
    logits the edge moves, and the drawn token still scores finite."""
    g = torch.Generator().manual_seed(11)
    rows = 1500
    logits, temperature, top_p = top_p_edge_rows(rows, 64, g)
    u = (1 - torch.rand(rows, generator=g) ** 4).clamp(max=1 - 2**-24)  # near 1: the last kept tokens
    tokens, logprobs = _engine_draws(logits, temperature, top_p, u)
    batch = _batch(tokens, logprobs, temperature, top_p)
    same = token_logprobs(_model(logits), batch)
    assert torch.isfinite(same).all()
    rare = rows // 100  # the two exps differ in a last bit in a few rows
    assert ((same[:, 0] - logprobs).abs() > 1e-5).sum() <= rare
    trainer = token_logprobs(_model(logits + torch.randn(logits.shape, generator=g) * 1e-5), batch)
    assert torch.isfinite(trainer).all()
