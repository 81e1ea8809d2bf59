"""Independent float64 reference of the processed sampling distribution
(docs/design.md): temperature, then top-k, top-p, min-p, renormalising
after each; and rows whose top-p edge rounding decides."""

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


def top_p_edge_rows(rows: int, vocab: int, g: torch.Generator):
    """`logits` `[rows, vocab]` in clusters of near-equal probabilities, `temperature` and
    `top_p` `[rows]`: each row's top_p within two float32 steps of the mass before a random
    rank, where the rounding of the sums decides which token is the last kept."""
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 0.3
    logits += torch.randint(0, 3, (rows, vocab), generator=g).float()
    temperature = torch.rand(rows, generator=g) + 0.5
    ordered = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True).values
    mass = torch.exp(ordered - ordered[:, :1]).double().cumsum(-1)
    rank = torch.randint(1, vocab, (rows, 1), generator=g)
    top_p = (mass.gather(1, rank - 1) / mass[:, -1:]).squeeze(1).float()
    steps = torch.randint(-2, 3, (rows,), generator=g)
    for k in range(2):
        top_p = torch.where(steps > k, torch.nextafter(top_p, torch.tensor(2.0)), top_p)
        top_p = torch.where(steps < -k, torch.nextafter(top_p, torch.tensor(0.0)), top_p)
    return logits, temperature, top_p.clamp(max=1.0)
