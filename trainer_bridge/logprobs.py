"""Trainer-side recompute of the rollout logprobs with the engine's exact
math (the same `rollout.engine.sampler.logprobs_of`), and the rollout-vs-trainer
mismatch every RL framework's users ask for."""

from __future__ import annotations

import torch

from rollout.engine.sampler import SamplingBatch, logprobs_of

from .batch import RolloutBatch
from .penalties import penalized_logits
from .routing_replay import routing_replay


def token_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, chunk_rows: int = 4096, replay_routing: bool = False
) -> torch.Tensor:
    """Log-probabilities `[B, R]` of the batch's response tokens under `model`
    (a Hugging Face causal LM, or any module returning `.logits`), computed in
    float32 with each row's temperature, filters and `logprobs_mode`; 0 on
    padding. A response token always counts as kept by the filters, so one
    that `model`'s logits put just past a top-p, min-p or top-k edge scores
    finite, never -inf (see `logprobs_of`). Penalties and `logit_bias` are
    applied from each token's history as the engine applied them. Differentiable; also sets
    `batch.mismatch` against the rollout's logprobs. `chunk_rows` bounds the
    `[tokens, vocab]` working set. `replay_routing=True` (mixture-of-experts models,
    a batch of rollouts that returned their routed experts): the forward uses the
    engine's experts (`routing_replay`); `ValueError` when the batch has none."""
    p = batch.prompt_ids.shape[1]
    r = batch.response_ids.shape[1]
    if replay_routing and batch.routed_experts is None:
        raise ValueError(
            "replay_routing=True needs batch.routed_experts: sample with SamplingParams(return_routed_experts=True)"
        )
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    if replay_routing:
        with routing_replay(model, batch.routed_experts):
            logits = model(**inputs).logits
    else:
        logits = model(**inputs).logits
    logits = logits[:, p - 1 : p + r - 1].float()  # the logits that predicted each response token
    mask = batch.response_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)
    values = []
    for start in range(0, rows.numel(), chunk_rows):
        rr, cc = rows[start : start + chunk_rows], cols[start : start + chunk_rows]
        chunk = penalized_logits(logits[rr, cc], batch, rr, cc)  # the engine's penalties, from the history
        values.append(logprobs_of(chunk, batch.response_ids[rr, cc], _sampling(batch, rr)))
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    if values:
        out = out.index_put((rows, cols), torch.cat(values))
    batch.mismatch = logprob_mismatch(batch.old_logprobs.to(out.device), out.detach(), mask)
    return out


def _sampling(batch: RolloutBatch, rows: torch.Tensor) -> SamplingBatch:
    return SamplingBatch.of(
        batch.temperature[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows], batch.logprobs_mode[rows]
    )


def logprob_mismatch(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |trainer - rollout| logprob over `mask`, and the k3
    estimate of KL(rollout || trainer): mean of exp(d) - 1 - d, d = trainer - rollout."""
    d = (trainer - rollout)[mask.bool()].double()
    if d.numel() == 0:
        return {"mean_abs": 0.0, "max_abs": 0.0, "k3_kl": 0.0}
    return {
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "k3_kl": float((d.exp() - 1 - d).mean()),
    }
