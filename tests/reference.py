"""Independent float64 reference of the processed sampling distribution
(docs/design.md): temperature, then top-k, top-p, min-p, renormalising
after each."""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """float64 log-probabilities `[V]` of the final distribution; -inf where dropped."""
    s = logits.double() / temperature
    order = torch.argsort(s, descending=True, stable=True)
    keep = torch.ones_like(s, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    probs = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    if top_p < 1:
        mass = 0.0
        for idx in order.tolist():
            if mass >= top_p:
                keep[idx] = False
            mass += probs[idx].item()
    probs = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    keep &= probs >= min_p * probs.max()
    return torch.log_softmax(s.masked_fill(~keep, float("-inf")), -1)
