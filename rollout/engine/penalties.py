"""Penalties and biases on the logits, as vLLM defines them, before the sampler.

For a row whose prompt holds the tokens `prompt_seen` and whose output so
far counts `counts[v]` of each token `v`:

    logits += bias                                     (logit_bias, per token id)
    seen = prompt_seen | counts > 0
    logits[seen] = logits / r where logits > 0, else logits * r   (repetition_penalty r)
    logits -= frequency_penalty * counts + presence_penalty * (counts > 0)

The sampler then applies temperature and filters to these logits, so the
"processed" and "scaled" logprobs are of the penalised distribution, the
one sampled; "raw" stays the model's own softmax (`raw_logprobs`). The
stepper applies them with torch ops on every path (the compiled CPU and
Triton samplers get the penalised logits); a decode step with such a row
runs without a captured decode graph, since the counts change every step.
`penalize` is the one definition: `trainer_bridge.token_logprobs` calls it
with each response position's history, so a trainer recomputes the
engine's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams


def penalize(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Penalised float32 `logits` `[R, V]` (a new tensor; differentiable):
    `counts` `[R, V]` float32 output-token counts, `prompt_seen` `[R, V]`
    bool, `frequency`/`presence`/`repetition` `[R]`, `bias` `[R, V]`."""
    logits = logits + bias
    seen = prompt_seen | (counts > 0)
    r = repetition[:, None]
    repeated = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, repeated, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def bias_rows(biases: list[dict[int, float] | None], vocab: int, device) -> torch.Tensor:
    """Dense `[R, V]` float32 biases from per-row `{token id: bias}` (ids past the vocabulary ignored)."""
    out = torch.zeros((len(biases), vocab), dtype=torch.float32)
    for i, b in enumerate(biases):
        for token, value in (b or {}).items():
            if token < vocab:
                out[i, token] += value
    return out.to(device)


@dataclass(slots=True)
class StepPenalties:
    """The penalised rows of one step and what they need, stacked on the host from
    the rows' kept counts (`PenaltyCounts`) and copied to the device once per step."""

    rows: torch.Tensor  # int64 [P]: which of the step's rows have penalties
    counts: torch.Tensor  # float32 [P, V]
    prompt_seen: torch.Tensor  # bool [P, V]
    frequency: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    repetition: torch.Tensor  # float32 [P]
    bias: torch.Tensor  # float32 [P, V]
    raw: torch.Tensor  # bool [P]: the row reports raw logprobs (the model's, unpenalised)

    @classmethod
    def of(cls, samplers: list, vocab: int, device) -> StepPenalties | None:
        """The step's penalties, or None when no row (`Sequence`) has any. A row's
        counts are its `Sequence.penalty` (kept as it samples), else rebuilt from its history."""
        picked = [(i, s) for i, s in enumerate(samplers) if has_penalties(s.request.params)]
        if not picked:
            return None
        kept = [s.penalty if s.penalty is not None else PenaltyCounts.of(s, vocab) for _, s in picked]
        params = [s.request.params for _, s in picked]

        def column(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(q, name)) for q in params], dtype=torch.float32, device=device)

        return cls(
            torch.tensor([i for i, _ in picked], dtype=torch.int64, device=device),
            torch.stack([k.counts for k in kept]).to(device),
            torch.stack([k.prompt_seen for k in kept]).to(device),
            column("frequency_penalty"),
            column("presence_penalty"),
            column("repetition_penalty"),
            bias_rows([q.logit_bias for q in params], vocab, device),
            torch.tensor([q.logprobs_mode == "raw" for q in params], device=device),
        )

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's logits `[N, V]` with the penalised rows penalised, to sample
        from; the same with the rows that report "raw" logprobs left as the model's,
        to report logprobs in): new tensors."""
        rows = logits.index_select(0, self.rows)
        args = (self.counts, self.prompt_seen, self.frequency, self.presence, self.repetition, self.bias)
        penalised = penalize(rows, *args)
        reported = torch.where(self.raw[:, None], rows, penalised)
        return logits.index_copy(0, self.rows, penalised), logits.index_copy(0, self.rows, reported)


class PenaltyCounts:
    """A penalised sample's token counts, kept with its `Sequence` (`Sequence.penalty`):
    `add` counts each sampled token (`Sequence.append` calls it), `reset` drops the
    outputs' counts (a restart); the prompt's tokens are marked once. A step stacks
    the rows' counts instead of rebuilding them from every row's history."""

    __slots__ = ("counts", "prompt_seen")

    def __init__(self, prompt: list[int], vocab: int) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32)  # output tokens so far
        self.prompt_seen = torch.zeros(vocab, dtype=torch.bool)
        self.prompt_seen[torch.tensor(prompt, dtype=torch.int64)] = True

    @classmethod
    def of(cls, seq, vocab: int) -> PenaltyCounts:
        """The counts of `seq` (a `Sequence`) from its history."""
        p = seq.num_prompt_tokens
        kept = cls(seq.token_ids[:p], vocab)
        out = torch.tensor(seq.token_ids[p:], dtype=torch.int64)
        kept.counts.index_add_(0, out, torch.ones(out.numel()))
        return kept

    def add(self, token: int) -> None:
        self.counts[token] += 1

    def reset(self) -> None:
        self.counts.zero_()


def has_penalties(params: SamplingParams) -> bool:
    return bool(
        params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1 or params.logit_bias
    )
