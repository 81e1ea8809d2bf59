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
the reverse KL's gradient, with no critic and no reward.

`topk_reverse_kl_loss` uses the teacher's top k instead of one sampled token:
at every response position it computes KL(student || teacher) exactly over
the tokens the teacher scored there (its k most likely, and the sampled
token) plus one tail bucket holding the rest of the vocabulary, whose
teacher mass is 1 minus the teacher's mass on those tokens (at least
`min_tail`, as the scored mass may round past 1). That is the reverse KL
between the two distributions lumped into those events: a lower bound of the
full reverse KL, equal to it where the tail is empty or both tails are
proportional, and 0 only where the student matches the teacher on every
scored token and in tail mass. Its gradient is dense over the scored tokens
(the student's full log-softmax at each position comes from the trainer's
forward, `response_log_softmax`)."""

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


def response_log_softmax(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """The student's float32 log-softmax `[B, R, vocab]` at the positions that
    predict the response tokens (`model` a Hugging Face causal LM); differentiable.
    The raw distribution: temperature and filters are not applied."""
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    return torch.log_softmax(model(**inputs).logits[:, p - 1 : p + r - 1].float(), dim=-1)


def topk_reverse_kl_loss(
    student_logprobs: torch.Tensor, batch: RolloutBatch, min_tail: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean over the response tokens (`batch.response_mask`) of KL(student ||
    teacher) over the teacher's top k and the sampled token plus a tail bucket (see the
    module docstring). `student_logprobs` `[B, R, vocab]` (`response_log_softmax`);
    `batch` carries the teacher's scores with top k (`teacher_logprobs` with
    `top_logprobs=k`, or `TrainerBridge(teacher_top_logprobs=k)`). Returns the loss and
    `distill/topk_reverse_kl` (its value)."""
    if batch.teacher_logprobs is None or batch.teacher_top_ids is None or batch.teacher_top_logprobs is None:
        raise ValueError(
            "batch has no teacher top-k logprobs: score it with teacher_logprobs(..., top_logprobs=k > 0) "
            "or TrainerBridge(teacher=..., teacher_top_logprobs=k > 0)"
        )
    b, r = batch.response_ids.shape
    if student_logprobs.dim() != 3 or student_logprobs.shape[:2] != (b, r):
        raise ValueError(
            f"student_logprobs must be [B, R, vocab] = [{b}, {r}, vocab], got {list(student_logprobs.shape)}"
        )
    if not isinstance(min_tail, float) or not 0 < min_tail < 1:
        raise ValueError(f"min_tail must be a float in (0, 1), got {min_tail!r}")
    top_ids, top_lp = batch.teacher_top_ids, batch.teacher_top_logprobs
    sampled = batch.response_ids[..., None]
    ids = torch.cat([top_ids, sampled], dim=-1)  # [B, R, k + 1]: the tokens the teacher scored
    teacher = torch.cat([top_lp, batch.teacher_logprobs[..., None]], dim=-1).double()
    # A slot counts once: padded top entries (-inf) and a sampled token among the top k do not.
    scored = torch.cat([torch.isfinite(top_lp), ~(top_ids == sampled).any(-1, keepdim=True)], dim=-1)
    student = student_logprobs.gather(-1, ids).double()
    s, t = student.exp() * scored, teacher.exp() * scored
    s_tail = (1 - s.sum(-1)).clamp(min=0)
    t_tail = (1 - t.sum(-1)).clamp(min=min_tail)
    inside = (s * torch.where(scored, student - teacher, 0)).sum(-1)
    kl = inside + s_tail * (s_tail.clamp(min=min_tail).log() - t_tail.log())
    m = batch.response_mask.bool()
    loss = torch.where(m, kl, 0).sum() / m.sum().clamp(min=1)
    return loss.to(student_logprobs.dtype), {"distill/topk_reverse_kl": float(loss.detach())}
