"""On-policy distillation: the student samples, a teacher scores every sampled
token (`Engine.score` / `RolloutCluster.score` on the teacher's checkpoint),
and the student learns the per-token reverse KL to the teacher.

`teacher_logprobs` fills `batch.teacher_logprobs` `[B, R]` (and, with
`top_logprobs=k`, the teacher's k most likely tokens per position in
`teacher_top_ids` / `teacher_top_logprobs` `[B, R, k]`). The teacher scores
each row's prompt and response as one sequence, from the response's first
token on (the prompt's pages may come from its prefix cache); it must share
the student's tokenizer (the ids are scored as they are).

`reverse_kl_loss` is the reverse KL KL(student || teacher) at the student's
own samples, as on-policy distillation optimises it: each sampled token's
advantage is `log p_teacher(x) - log p_old(x)` (minus the per-token KL
estimate), in the clipped surrogate of `grpo.clipped_policy_loss`, so with
the rollout policy as the old one its gradient is the sampled estimate of
the reverse KL's gradient, with no critic and no reward."""

from __future__ import annotations

import torch

from rollout import Engine, RolloutCluster, SamplingParams

from .batch import RolloutBatch


def teacher_logprobs(
    teacher: Engine | RolloutCluster,
    batch: RolloutBatch,
    top_logprobs: int = 0,
    params: SamplingParams | None = None,
) -> RolloutBatch:
    """`batch` with the teacher's logprob of every response token (0 on padding);
    `params` is the teacher's distribution (None: its raw log-softmax)."""
    if not isinstance(teacher, (Engine, RolloutCluster)):
        raise TypeError(f"teacher must be an Engine or a RolloutCluster, got {type(teacher).__name__}")
    response = batch.response_mask if batch.response_attention is None else batch.response_attention
    seqs, starts = [], []
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        seqs.append(prompt + batch.response_ids[i][: int(response[i].sum())].tolist())
        starts.append(len(prompt))
    scored = teacher.score(seqs, top_logprobs, params, start=starts)
    b, r = batch.response_ids.shape
    lp = torch.zeros(b, r, dtype=torch.float32)
    top_ids = torch.zeros(b, r, top_logprobs, dtype=torch.int64)
    top_lp = torch.full((b, r, top_logprobs), float("-inf"))
    for i, (s, start) in enumerate(zip(scored, starts, strict=True)):
        n = len(s.token_ids) - start
        if n:
            lp[i, :n] = torch.tensor(s.logprobs[start:])
        for j in range(n) if top_logprobs else ():
            best = sorted(s.top_logprobs[start + j].items(), key=lambda item: -item[1])[:top_logprobs]
            top_ids[i, j, : len(best)] = torch.tensor([t for t, _ in best])
            top_lp[i, j, : len(best)] = torch.tensor([v for _, v in best])
    batch.teacher_logprobs = lp * batch.response_mask
    if top_logprobs:
        batch.teacher_top_ids, batch.teacher_top_logprobs = top_ids, top_lp
    return batch


def reverse_kl_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate with per-token advantages `teacher - old` (`[B, R]`
    each), averaged over the tokens in `mask`; and `reverse_kl`, the mean sampled
    estimate of KL(old || teacher) over them (what the loss drives to 0)."""
    m = mask.float()
    advantages = (teacher - old_logprobs).detach() * m
    ratio = torch.exp(new_logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    tokens = m.sum().clamp(min=1)
    loss = -(surrogate * m).sum() / tokens
    return loss, {"distill/reverse_kl": float(-(advantages * m).sum() / tokens)}
