"""The engine's penalties and biases recomputed from a batch's token history:
for the response token at column c of row b, the output so far is that row's
response tokens before c, the prompt its real prompt tokens; the logits are
then penalised by `rollout.engine.penalties.penalize`, the engine's own
definition. Rows reporting "raw" logprobs keep the model's logits, as the
engine reports them."""

from __future__ import annotations

import torch

from rollout.engine.penalties import bias_rows, penalize
from rollout.engine.sampler import MODE_CODES

from .batch import RolloutBatch


def penalized_logits(logits: torch.Tensor, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`logits` `[C, V]` (those predicting `batch.response_ids[rows, cols]`) penalised
    as the engine penalised them; unchanged when the batch has no penalties."""
    if batch.frequency_penalty is None:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    history = batch.response_ids[rows]  # [C, R]
    span = torch.arange(history.shape[1], device=history.device)[None, :]
    before = ((span < cols[:, None]) & batch.response_mask[rows].bool()).to(torch.float32)
    counts = torch.zeros((rows.numel(), vocab), dtype=torch.float32, device=history.device)
    counts.scatter_add_(1, history, before)
    seen = torch.zeros_like(counts).scatter_add_(1, batch.prompt_ids[rows], batch.prompt_mask[rows].float()) > 0
    bias = bias_rows([batch.logit_bias[i] for i in rows.tolist()], vocab, device)
    terms = (batch.frequency_penalty[rows], batch.presence_penalty[rows], batch.repetition_penalty[rows])
    out = penalize(logits, counts.to(device), seen.to(device), *(t.to(device) for t in terms), bias)
    raw = (batch.logprobs_mode[rows] == MODE_CODES["raw"]).to(device)
    return torch.where(raw[:, None], logits, out)
