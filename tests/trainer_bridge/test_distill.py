"""On-policy distillation: a teacher engine of another checkpoint scores the
student's samples as transformers' teacher-forced forward of that checkpoint
does; a bridge with a teacher fills every batch; the reverse-KL loss against a
hand-computed case, and its steps shrink the exact reverse KL of a small
categorical policy."""

from __future__ import annotations

import copy

import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import hf_logprobs
from trainer_bridge import RolloutBatch, TrainerBridge, reverse_kl_loss, teacher_logprobs

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


def test_reverse_kl_steps_shrink_the_exact_reverse_kl_of_a_categorical_policy():
    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64) * 2, -1)
    logits = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)

    def exact_kl() -> float:
        p = torch.log_softmax(logits.detach(), -1)
        return float((p.exp() * (p - teacher)).sum())

    start = exact_kl()
    for _ in range(200):
        old = torch.log_softmax(logits.detach(), -1)
        tokens = torch.multinomial(old.exp(), 64, replacement=True, generator=g)
        new = torch.log_softmax(logits, -1)[tokens][None]
        loss, _ = reverse_kl_loss(new, old[tokens][None], teacher[tokens][None], torch.ones(1, 64))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert exact_kl() < 0.05 * start
