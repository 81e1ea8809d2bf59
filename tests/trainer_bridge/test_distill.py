"""On-policy distillation: a teacher engine of another checkpoint scores the
student's samples as transformers' teacher-forced forward of that checkpoint
does; a bridge with a teacher fills every batch; the reverse-KL loss against a
hand-computed case, and its steps shrink the exact reverse KL of a small
categorical policy."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import hf_logprobs
from trainer_bridge import RolloutBatch, TrainerBridge, reverse_kl_loss, teacher_logprobs
from trainer_bridge.distill import response_log_softmax, topk_reverse_kl_loss

PROMPTS = [list(range(3, 3 + k)) for k in (5, 12, 3)]
PARAMS = SamplingParams(n=2, max_tokens=10, seed=3, temperature=1.0, ignore_eos=True)


class Log:
    def __init__(self) -> None:
        self.values: dict = {}

    def log(self, values: dict) -> None:
        self.values.update(values)


def test_teacher_logprobs_equal_the_teacher_checkpoint_in_transformers(checkpoints):
    student, teacher = checkpoints["qwen2"], checkpoints["llama"]  # the same vocabulary, other weights
    outs = make_engine(student.path).generate(PROMPTS, PARAMS)
    batch = RolloutBatch.from_outputs(outs, PARAMS, 0)
    batch = teacher_logprobs(make_engine(teacher.path), batch, top_logprobs=3)
    rows = [(o, s) for o in outs for s in o.samples]
    for i, (out, s) in enumerate(rows):
        n = len(s.token_ids)
        ref = hf_logprobs(teacher.hf, out.prompt_token_ids, s.token_ids).float()
        assert torch.allclose(batch.teacher_logprobs[i, :n], ref, atol=1e-5)
        assert not batch.teacher_logprobs[i, n:].any()
        with torch.no_grad():
            logits = teacher.hf(torch.tensor([out.prompt_token_ids + s.token_ids])).logits[0].float()
        best = torch.log_softmax(logits[len(out.prompt_token_ids) - 1 : -1], -1).topk(3)
        assert torch.equal(batch.teacher_top_ids[i, :n], best.indices)
        assert torch.allclose(batch.teacher_top_logprobs[i, :n], best.values, atol=1e-5)
    # The top-k reverse KL of the student checkpoint on this batch, against a float64 loop over
    # each position's lumped distributions (the teacher's top 3 and the sampled token, then the rest).
    with torch.no_grad():
        loss, _ = topk_reverse_kl_loss(response_log_softmax(student.hf, batch), batch)
    kls = []
    for out, s in rows:
        ids = torch.tensor([out.prompt_token_ids + s.token_ids])
        p0 = len(out.prompt_token_ids)
        with torch.no_grad():
            ps = torch.softmax(student.hf(ids).logits[0, p0 - 1 : -1].double(), -1)
            pt = torch.softmax(teacher.hf(ids).logits[0, p0 - 1 : -1].double(), -1)
        for j, token in enumerate(s.token_ids):
            support = set(pt[j].topk(3).indices.tolist()) | {token}
            inside = sum(ps[j, t] * math.log(ps[j, t] / pt[j, t]) for t in support)
            rest_s = 1 - sum(ps[j, t] for t in support)
            rest_t = 1 - sum(pt[j, t] for t in support)
            kls.append(float(inside + rest_s * math.log(rest_s / rest_t)))
    assert abs(loss.item() - sum(kls) / len(kls)) < 1e-4


def test_a_bridge_with_a_teacher_scores_every_batch_and_logs_the_reverse_kl(checkpoints):
    student, teacher = make_engine(checkpoints["qwen2"].path), make_engine(checkpoints["llama"].path)
    log = Log()
    batch = TrainerBridge(student, teacher=teacher, metrics=log).generate(PROMPTS, PARAMS)
    expected = teacher_logprobs(teacher, copy.copy(batch), 0)
    m = batch.response_mask.bool()
    assert torch.equal(batch.teacher_logprobs, expected.teacher_logprobs)
    kl = (batch.old_logprobs - batch.teacher_logprobs)[m].mean().item()
    assert abs(log.values["distill/reverse_kl"] - kl) < 1e-6 and kl > 0


def test_reverse_kl_loss_against_a_hand_computed_case():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    new = old.clone().requires_grad_(True)
    loss, stats = reverse_kl_loss(new, old, teacher, mask)
    advantages = [-0.5, 1.0, 0.0, 0.2]  # teacher - old on the 4 tokens in the mask
    assert abs(loss.item() + sum(advantages) / 4) < 1e-6
    assert abs(stats["distill/reverse_kl"] + sum(advantages) / 4) < 1e-6
    loss.backward()
    expected = torch.tensor([[0.5, -1.0, 0.0], [-0.2, 0.0, 0.0]]) / 4  # d loss / d new at ratio 1
    assert torch.allclose(new.grad, expected, atol=1e-6)


def exact_kl(logits: torch.Tensor, teacher: torch.Tensor) -> float:
    """KL(student || teacher) over the whole categorical, in float64: the reference the losses' steps shrink."""
    p = torch.log_softmax(logits.detach(), -1)
    return float((p.exp() * (p - teacher)).sum())


def test_reverse_kl_steps_shrink_the_exact_reverse_kl_of_a_categorical_policy():
    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64) * 2, -1)
    logits = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)

    start = exact_kl(logits, teacher)
    for _ in range(200):
        old = torch.log_softmax(logits.detach(), -1)
        tokens = torch.multinomial(old.exp(), 64, replacement=True, generator=g)
        new = torch.log_softmax(logits, -1)[tokens][None]
        loss, _ = reverse_kl_loss(new, old[tokens][None], teacher[tokens][None], torch.ones(1, 64))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert exact_kl(logits, teacher) < 0.05 * start


def _scored(teacher: torch.Tensor, tokens: torch.Tensor, k: int, mask=None) -> SimpleNamespace:
    """What `teacher_logprobs` leaves on a batch, from a teacher's full log-softmax `[B, R, V]`."""
    top = teacher.topk(k, dim=-1)
    mask = torch.ones(tokens.shape, dtype=torch.int64) if mask is None else mask
    picked = teacher.gather(-1, tokens[..., None]).squeeze(-1)
    return SimpleNamespace(
        response_ids=tokens, response_mask=mask, teacher_logprobs=picked * mask,
        teacher_top_ids=top.indices, teacher_top_logprobs=top.values,
    )  # fmt: skip


def test_topk_reverse_kl_against_a_hand_computed_case():
    """Position 0 samples a token among the teacher's top 2, position 1 one outside (its
    teacher logprob joins the scored set), position 2 is padding: each position's KL is
    over its scored tokens and one tail bucket, computed here by hand."""
    student = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.25, 0.05], [0.25] * 4], dtype=torch.float64).log()
    batch = SimpleNamespace(
        response_ids=torch.tensor([[0, 1, 2]]), response_mask=torch.tensor([[1, 1, 0]]),
        teacher_logprobs=torch.tensor([[math.log(0.3), math.log(0.1), 0.0]], dtype=torch.float64),  # 0: padding
        teacher_top_ids=torch.tensor([[[1, 0], [2, 3], [0, 1]]]),
        teacher_top_logprobs=torch.tensor([[[0.6, 0.3], [0.5, 0.2], [0.5, 0.5]]], dtype=torch.float64).log(),
    )  # fmt: skip
    first = 0.2 * math.log(0.2 / 0.6) + 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.1)  # tail {2, 3}
    second = sum(s * math.log(s / t) for s, t in [(0.25, 0.5), (0.05, 0.2), (0.6, 0.1), (0.1, 0.2)])  # tail {0}
    loss, stats = topk_reverse_kl_loss(student[None], batch)
    assert abs(loss.item() - (first + second) / 2) < 1e-12
    assert stats["distill/topk_reverse_kl"] == pytest.approx((first + second) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="teacher top-k"):
        topk_reverse_kl_loss(student[None], SimpleNamespace(**{**vars(batch), "teacher_top_ids": None}))
    with pytest.raises(ValueError, match="student_logprobs"):
        topk_reverse_kl_loss(student, batch)


def test_topk_reverse_kl_is_the_full_reverse_kl_when_k_covers_the_vocabulary_and_bounds_it_below():
    g = torch.Generator().manual_seed(1)
    student = torch.log_softmax(torch.randn(2, 5, 9, generator=g, dtype=torch.float64) * 2, -1)
    teacher = torch.log_softmax(torch.randn(2, 5, 9, generator=g, dtype=torch.float64) * 2, -1)
    tokens = torch.randint(0, 9, (2, 5), generator=g)
    full = (student.exp() * (student - teacher)).sum(-1)  # [2, 5]
    loss, _ = topk_reverse_kl_loss(student, _scored(teacher, tokens, 9))
    assert abs(loss.item() - full.mean().item()) < 1e-9
    for k in (1, 3, 6):
        for b in range(2):
            for r in range(5):
                row = _scored(teacher[b : b + 1, r : r + 1], tokens[b : b + 1, r : r + 1], k)
                part, _ = topk_reverse_kl_loss(student[b : b + 1, r : r + 1], row)
                assert -1e-12 <= part.item() <= full[b, r].item() + 1e-12


def test_topk_reverse_kl_gradient_and_steps_shrink_the_exact_reverse_kl():
    g = torch.Generator().manual_seed(2)
    teacher = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64) * 2, -1)
    tokens = torch.randint(0, 12, (1, 4), generator=g)
    batch = _scored(teacher.expand(1, 4, 12), tokens, 3)
    logits = torch.randn(1, 4, 12, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: topk_reverse_kl_loss(torch.log_softmax(x, -1), batch)[0], (logits,), fast_mode=True
    )
    logits = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)

    start = exact_kl(logits, teacher)
    for _ in range(60):
        tokens = torch.multinomial(torch.softmax(logits.detach(), -1), 8, replacement=True, generator=g)[None]
        loss, _ = topk_reverse_kl_loss(
            torch.log_softmax(logits, -1).expand(1, 8, 12), _scored(teacher.expand(1, 8, 12), tokens, 3)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    # The tail's shape is learnt only through sampled tokens: the lower bound falls first.
    assert exact_kl(logits, teacher) < 0.25 * start
