"""trainer_bridge/corrections.py against hand-computed cases (ratios in powers
of two), a plain-Python loop recompute of the definitions on random tensors,
grpo's `clipped_policy_loss`, and the exact KL of two small categoricals. The
definitions are in corrections.py and docs/off_policy.md."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_bridge import Correction, CorrectionResult, corrected_policy_loss, correction_weights, logprob_mismatch
from trainer_bridge.corrections import METRIC_KEYS
from trainer_bridge.grpo import clipped_policy_loss

L2 = math.log(2)
NAN = float("nan")


def _hand_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows, ratios in powers of two; row 2 is empty; padding holds NaN, inf and huge values.

    row 0: ratios 0.5 1 2 4, all in the mask        (log2 units -1 0 1 2, row sum 2 -> ratio 4)
    row 1: ratios 2 2 2, then padding               (1 1 1, row sum 3 -> ratio 8)
    row 2: nothing in the mask
    row 3: ratios 0.5 0.5, then padding             (-1 -1, row sum -2 -> ratio 0.25)
    """
    trainer = torch.tensor(
        [[-L2, 0.0, L2, 2 * L2], [L2, L2, L2, NAN], [7.0, -3.0, NAN, math.inf], [-L2, -L2, 30.0, -30.0]],
        dtype=torch.float64,
    )
    rollout = torch.zeros(4, 4, dtype=torch.float64)
    rollout[2, 3] = -math.inf  # inf - (-inf) under padding: never read
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    return trainer, rollout, mask


# Over the 9 tokens in the mask of _hand_batch, whatever the method:
#   ratios 0.5 1 2 4 | 2 2 2 | 0.5 0.5 -> mean 14.5 / 9, max 4
#   log-ratios (log 2 units) -1 0 1 2 | 1 1 1 | -1 -1 -> sum 3, sum of squares 11
#   k1 = -3 log2 / 9; k2 = 11 (log 2)^2 / 18; k3 = (sum(r - 1) - sum(log r)) / 9 = (5.5 - 3 log 2) / 9
#   row ratios 4, 8, 0.25 over the 3 non-empty rows -> mean 12.25 / 3, max 8
SHARED = {"is/ratio_mean": 14.5 / 9, "is/ratio_max": 4.0, "is/seq_ratio_mean": 12.25 / 3, "is/seq_ratio_max": 8.0}
SHARED.update({"kl/k1": -3 * L2 / 9, "kl/k2": 11 * L2**2 / 18, "kl/k3": (5.5 - 3 * L2) / 9})


def _expect(metrics: dict[str, float], **values: float) -> None:
    assert list(metrics) == list(METRIC_KEYS)
    want = {**dict.fromkeys(METRIC_KEYS, 0.0), **SHARED, **{k.replace("__", "/"): v for k, v in values.items()}}
    assert metrics == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert all(type(v) is float for v in metrics.values())


def test_token_tis_by_hand():
    # clip 2: min(0.5, 2) = 0.5, min(1, 2) = 1, min(2, 2) = 2 (not clipped: 2 is not above 2), min(4, 2) = 2
    # clipped: only the 4 -> 1 of 9 tokens, 1 of 3 non-empty rows; weights sum 0.5+1+2+2 + 6 + 1 = 12.5
    weights, metrics = correction_weights(*_hand_batch())  # the defaults: tis, token level, clip 2
    want = [[0.5, 1, 2, 2], [2, 2, 2, 0], [0, 0, 0, 0], [0.5, 0.5, 0, 0]]
    assert weights.tolist() == want
    _expect(metrics, is__clip_fraction=1 / 9, is__seq_clip_fraction=1 / 3, is__weight_mean=12.5 / 9)


def test_sequence_tis_by_hand():
    # row 0: log-ratios sum to log 4 -> min(4, 2) = 2 on its 4 tokens (clipped)
    # row 1: log-ratios sum to log 8 -> min(8, 2) = 2 on its 3 tokens (clipped)
    # row 3: sum log 0.25 -> 0.25 on its 2 tokens; row 2 empty -> 0
    # clipped: 7 of 9 tokens, 2 of 3 rows; weights sum 8 + 6 + 0.5 = 14.5
    weights, metrics = correction_weights(*_hand_batch(), method="tis", level="sequence", clip=2.0)
    assert weights.tolist() == [[2, 2, 2, 2], [2, 2, 2, 0], [0, 0, 0, 0], [0.25, 0.25, 0, 0]]
    _expect(metrics, is__clip_fraction=7 / 9, is__seq_clip_fraction=2 / 3, is__weight_mean=14.5 / 9)


def test_token_mis_by_hand():
    # [0.5, 2], bounds inclusive: only the 4 leaves -> masked (0), not clipped to 2
    # keep="ratio": kept tokens weigh their ratio; weights sum 0.5+1+2 + 6 + 1 = 10.5
    weights, metrics = correction_weights(*_hand_batch(), method="mis", low=0.5, high=2.0)
    assert weights.tolist() == [[0.5, 1, 2, 0], [2, 2, 2, 0], [0, 0, 0, 0], [0.5, 0.5, 0, 0]]
    _expect(metrics, is__mask_fraction=1 / 9, is__seq_mask_fraction=1 / 3, is__weight_mean=10.5 / 9)
    # keep="one": kept tokens weigh 1, 8 of 9 kept
    weights, metrics = correction_weights(*_hand_batch(), method="mis", low=0.5, high=2.0, keep="one")
    assert weights.tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    _expect(metrics, is__mask_fraction=1 / 9, is__seq_mask_fraction=1 / 3, is__weight_mean=8 / 9)


def test_sequence_mis_by_hand():
    # [0.2, 5] on row ratios 4, 8, 0.25: row 1 (8) leaves -> its 3 tokens masked; 1 of 3 rows
    # keep="ratio": row 0 weighs 4, row 3 0.25: sum 16 + 0.5 = 16.5; keep="one": 4 + 2 = 6
    weights, metrics = correction_weights(*_hand_batch(), method="mis", level="sequence", low=0.2, high=5.0)
    assert weights.tolist() == [[4, 4, 4, 4], [0, 0, 0, 0], [0, 0, 0, 0], [0.25, 0.25, 0, 0]]
    _expect(metrics, is__mask_fraction=3 / 9, is__seq_mask_fraction=1 / 3, is__weight_mean=16.5 / 9)
    weights, metrics = correction_weights(*_hand_batch(), method="mis", level="sequence", low=0.2, high=5.0, keep="one")
    assert weights.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    _expect(metrics, is__mask_fraction=3 / 9, is__seq_mask_fraction=1 / 3, is__weight_mean=6 / 9)
    # the defaults [0.5, 2]: every row leaves (4 > 2, 8 > 2, 0.25 < 0.5) -> all weights 0
    weights, metrics = correction_weights(*_hand_batch(), method="mis", level="sequence")
    assert (weights == 0).all()
    _expect(metrics, is__mask_fraction=1.0, is__seq_mask_fraction=1.0, is__weight_mean=0.0)


def test_icepop_by_hand():
    # keep where 0.6 <= rho <= 3: masks both 0.5s of row 3, row 0's 0.5 and its 4 -> 4 of 9 tokens, rows 0 and 3
    # kept tokens weigh their ratio (IcePop's M(k) = k): sum 1 + 2 + 6 = 9
    weights, metrics = correction_weights(*_hand_batch(), method="icepop", low=0.6, high=3.0)
    assert weights.tolist() == [[0, 1, 2, 0], [2, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    _expect(metrics, is__mask_fraction=4 / 9, is__seq_mask_fraction=2 / 3, is__weight_mean=9 / 9)
    mis = correction_weights(*_hand_batch(), method="mis", low=0.6, high=3.0)  # the same arithmetic
    assert torch.equal(mis.weights, weights) and mis.metrics == metrics
    # defaults [0.5, 5]: nothing leaves; the weights are the ratios
    weights, metrics = correction_weights(*_hand_batch(), method="icepop")
    assert weights.tolist() == [[0.5, 1, 2, 4], [2, 2, 2, 0], [0, 0, 0, 0], [0.5, 0.5, 0, 0]]
    _expect(metrics, is__weight_mean=14.5 / 9)


def _loop_reference(trainer, rollout, mask, c: Correction) -> tuple[list[list[float]], dict[str, float]]:
    """The definitions, one token at a time in Python floats."""
    bound = lambda x: max(-20.0, min(20.0, x))

    def rule(x: float) -> tuple[float, bool]:
        if c.method == "tis":
            return min(x, c.clip), x > c.clip
        kept = c.low <= x <= c.high
        return ((x if c.keep == "ratio" else 1.0) if kept else 0.0), not kept

    b, r = len(mask), len(mask[0])
    weights = [[0.0] * r for _ in range(b)]
    lrs, hits, row_hits, row_ratios = [], 0, 0, []
    for i in range(b):
        cols = [j for j in range(r) if mask[i][j]]
        if not cols:
            continue
        lr = {j: bound(trainer[i][j] - rollout[i][j]) for j in cols}
        row_ratio = math.exp(bound(sum(lr.values())))
        row_ratios.append(row_ratio)
        flags = []
        for j in cols:
            weights[i][j], hit = rule(math.exp(lr[j]) if c.level == "token" else row_ratio)
            flags.append(hit)
        hits += sum(flags)
        row_hits += any(flags)
        lrs += lr.values()
    n, rows = len(lrs), len(row_ratios)
    ratios = [math.exp(x) for x in lrs]
    kept = [w for i in range(b) for j, w in enumerate(weights[i]) if mask[i][j]]
    tis = c.method == "tis"
    metrics = {
        "is/clip_fraction": hits / n if tis else 0.0,
        "is/mask_fraction": 0.0 if tis else hits / n,
        "is/seq_clip_fraction": row_hits / rows if tis else 0.0,
        "is/seq_mask_fraction": 0.0 if tis else row_hits / rows,
        "is/ratio_mean": sum(ratios) / n,
        "is/ratio_max": max(ratios),
        "is/seq_ratio_mean": sum(row_ratios) / rows,
        "is/seq_ratio_max": max(row_ratios),
        "is/weight_mean": sum(kept) / n,
        "kl/k1": sum(-x for x in lrs) / n,
        "kl/k2": sum(0.5 * x * x for x in lrs) / n,
        "kl/k3": sum(math.exp(x) - 1 - x for x in lrs) / n,
    }
    return weights, metrics


@pytest.mark.parametrize(
    "correction",
    [
        Correction("tis", "token", clip=1.5),
        Correction("tis", "sequence", clip=3.0),
        Correction("mis", "token", low=0.6, high=1.8),
        Correction("mis", "token", low=0.6, high=1.8, keep="one"),
        Correction("mis", "sequence", low=0.1, high=6.0),
        Correction("mis", "sequence", low=0.0, high=2.0, keep="one"),
        Correction("icepop", low=0.5, high=1.5),
    ],
    ids=repr,
)
def test_random_batches_match_a_loop_recompute(correction):
    g = torch.Generator().manual_seed(7)
    rollout = -4 * torch.rand(6, 9, generator=g)
    trainer = rollout + 0.6 * torch.randn(6, 9, generator=g)  # ratios on both sides of every bound
    trainer[1, 2] = rollout[1, 2] + 45.0  # past the clamp: weighs as e^20 would
    mask = torch.rand(6, 9, generator=g) < 0.7
    mask[1, 2] = True
    mask[4] = False  # an empty row
    weights, metrics = correction.weights(trainer, rollout, mask)
    want_w, want_m = _loop_reference(trainer.double().tolist(), rollout.double().tolist(), mask.tolist(), correction)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), torch.tensor(want_w, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert metrics == pytest.approx(want_m, rel=1e-9, abs=1e-12)
    hit = metrics["is/clip_fraction"] + metrics["is/mask_fraction"]
    assert 0 < hit < 1  # the case exercises both sides of the rule


def test_huge_log_ratios_stay_finite():
    # +-1000 per token: clamped to +-20 before exp; a row of 50 tokens at +15 sums to 750 -> clamped to 20
    trainer = torch.tensor([[1000.0, -1000.0, 0.0] + [0.0] * 47, [15.0] * 50], dtype=torch.float64)
    rollout = torch.zeros_like(trainer)
    mask = torch.ones_like(trainer, dtype=torch.bool)
    w, metrics = correction_weights(trainer, rollout, mask, clip=2.0)
    assert w[0, :3].tolist() == [2.0, math.exp(-20), 1.0]
    assert metrics["is/ratio_max"] == pytest.approx(math.exp(20))
    assert all(math.isfinite(v) for v in metrics.values())
    w, metrics = correction_weights(trainer, rollout, mask, level="sequence", clip=2.0)
    assert (w[1] == 2.0).all() and metrics["is/seq_ratio_max"] == pytest.approx(math.exp(20))


def test_k3_is_zero_on_policy_and_grows_with_the_gap():
    g = torch.Generator().manual_seed(0)
    rollout = -3 * torch.rand(8, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(8, 16, dtype=torch.bool)
    same = correction_weights(rollout.clone(), rollout, mask).metrics
    assert same["kl/k1"] == same["kl/k2"] == same["kl/k3"] == 0.0
    assert same["is/ratio_mean"] == 1.0 and same["is/clip_fraction"] == 0.0
    noise = torch.randn(8, 16, generator=g, dtype=torch.float64)
    k3 = [correction_weights(rollout + s * noise, rollout, mask).metrics["kl/k3"] for s in (0.01, 0.1, 0.5)]
    assert 0 < k3[0] < 1e-3 < k3[1] < k3[2]
    assert k3[2] == pytest.approx(logprob_mismatch(rollout, rollout + 0.5 * noise, mask)["k3_kl"], rel=1e-12)


def test_kl_estimators_match_the_exact_kl_of_two_categoricals():
    # Tokens sampled from the rollout's p; the exact KL(p || q) = sum p log(p / q).
    # k1 and k3 are unbiased estimates of it; k2 is biased, close when p and q are close.
    # Seeded: KL 0.038; 200k samples put k1 and k3 within 0.6% of it and k2 within 2%.
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.tensor([0.3, -0.2, 1.0, 0.0, -1.5], dtype=torch.float64), 0)
    q = torch.softmax(torch.log(p) + 0.5 * torch.randn(5, generator=g, dtype=torch.float64), 0)
    exact = float((p * (p / q).log()).sum())
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=g).view(400, 500)
    _, m = correction_weights(q.log()[tokens], p.log()[tokens], torch.ones_like(tokens))
    assert exact == pytest.approx(0.0378, abs=1e-4)
    assert m["kl/k1"] == pytest.approx(exact, rel=0.03)
    assert m["kl/k3"] == pytest.approx(exact, rel=0.02)
    assert m["kl/k2"] == pytest.approx(exact, rel=0.05)


def test_padding_and_empty_rows_are_never_counted():
    trainer, rollout, mask = _hand_batch()
    full = correction_weights(trainer, rollout, mask)
    # other garbage under the padding, the mask as bool or float: the same result
    trainer2 = torch.where(mask.bool(), trainer, torch.full_like(trainer, -5e8))
    for m in (mask.bool(), mask.double()):
        other = correction_weights(trainer2, rollout, m)
        assert torch.equal(other.weights, full.weights) and other.metrics == full.metrics
    # nothing in the mask: weights 0, metrics 0.0, the same keys
    weights, metrics = correction_weights(trainer, rollout, torch.zeros_like(mask), method="mis", level="sequence")
    assert (weights == 0).all() and metrics == dict.fromkeys(METRIC_KEYS, 0.0)


def test_weights_are_detached_and_keep_device_and_a_float_dtype():
    trainer = torch.randn(3, 4, requires_grad=True)
    result = correction_weights(trainer, torch.randn(3, 4), torch.ones(3, 4))
    assert isinstance(result, CorrectionResult) and not result.weights.requires_grad
    assert result.weights.device == trainer.device and result.weights.dtype == torch.float32
    bf16 = correction_weights(trainer.detach().bfloat16(), torch.zeros(3, 4, dtype=torch.bfloat16), torch.ones(3, 4))
    assert bf16.weights.dtype == torch.float32
    f64 = correction_weights(trainer.detach().double(), torch.zeros(3, 4, dtype=torch.float64), torch.ones(3, 4))
    assert f64.weights.dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu():
    for kwargs in ({}, {"level": "sequence"}, {"method": "mis", "level": "sequence"}, {"method": "icepop"}):
        cpu = correction_weights(*_hand_batch(), **kwargs)
        gpu = correction_weights(*(t.cuda() for t in _hand_batch()), **kwargs)
        assert gpu.weights.is_cuda and torch.equal(gpu.weights.cpu(), cpu.weights)
        assert gpu.metrics == pytest.approx(cpu.metrics, rel=1e-12, abs=1e-15)
    new, old, adv, mask = (t.detach().cuda() for t in _loss_case())
    loss = corrected_policy_loss(new.requires_grad_(True), old, adv, mask, torch.ones_like(new))
    assert loss.is_cuda and loss.item() == pytest.approx(clipped_policy_loss(new, old, adv, mask).item(), abs=1e-7)


def _loss_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grpo's hand case: old logprobs, new ones log(ratio) above them, advantages +1 and -2."""
    old = torch.tensor([[-1.0, -2.0, -0.5]] * 2)
    new = old + torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.5), math.log(0.5), 5.0]])
    return new.requires_grad_(True), old, torch.tensor([1.0, -2.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_corrected_policy_loss_by_hand():
    # clip 0.2, surrogates as in test_grpo: row 0 (A = +1) 1.2 0.5 1.0; row 1 (A = -2) -3.0 -1.6, then masked
    # weights 2 0 1 | 0.5 1 7: 2.4 + 0 + 1.0 - 1.5 - 1.6 = 0.3 (the masked token's 7 never counts)
    #   denominator "mask": 5 tokens -> loss -0.06; "kept": the weight-0 token leaves -> 4 -> -0.075
    new, old, adv, mask = _loss_case()
    weights = torch.tensor([[2.0, 0.0, 1.0], [0.5, 1.0, 7.0]], requires_grad=True)
    old.requires_grad_(True)
    adv.requires_grad_(True)
    loss = corrected_policy_loss(new, old, adv, mask, weights)
    assert loss.item() == pytest.approx(-0.06, abs=1e-6)
    kept = corrected_policy_loss(new, old, adv, mask, weights, denominator="kept")
    assert kept.item() == pytest.approx(-0.075, abs=1e-6)
    # d loss / d new = -(w * ratio * A) / 5 where the unclipped term is the minimum, else 0:
    #   row 0: 1.5 clipped -> 0; 0.5 unclipped but weight 0 -> 0
    #   row 1: 1.5 -> -(0.5 * 1.5 * -2) / 5 = 0.3; 0.5 clipped -> 0; masked -> 0
    loss.backward()
    assert [new.grad[0, 0].item(), new.grad[0, 1].item()] == pytest.approx([0.0, 0.0], abs=1e-7)
    assert new.grad[1].tolist() == pytest.approx([0.3, 0.0, 0.0], abs=1e-6)
    assert weights.grad is None and old.grad is None and adv.grad is None


def test_all_ones_weights_give_clipped_policy_loss_exactly():
    g = torch.Generator().manual_seed(5)
    old = -3 * torch.rand(6, 7, generator=g)
    new = (old + 0.5 * torch.randn(6, 7, generator=g)).requires_grad_(True)
    adv = torch.randn(6, generator=g)
    mask = (torch.rand(6, 7, generator=g) < 0.7).long()
    mask[2] = 0
    ones = torch.where(mask.bool(), 1.0, NAN)  # off the mask, weights are never read
    for clip in (0.2, 0.6):
        want = clipped_policy_loss(new, old, adv, mask, clip=clip)
        (want_grad,) = torch.autograd.grad(want, new)
        for denominator in ("mask", "kept"):
            got = corrected_policy_loss(new, old, adv, mask, ones, clip=clip, denominator=denominator)
            (got_grad,) = torch.autograd.grad(got, new)
            assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    empty = corrected_policy_loss(new, old, adv, torch.zeros_like(mask), torch.ones(6, 7))
    assert empty.item() == 0.0  # 0 / max(0, 1), not NaN


def test_corrections_feed_the_loss():
    # One optimizer step per batch: the trainer's old logprobs are the new ones, detached.
    new, old, adv, mask = _loss_case()
    weights, _ = correction_weights(new.detach(), old, mask, method="tis", clip=1.2)
    # ratios to the rollout 1.5 0.5 1 | 1.5 0.5 (e^5 masked) -> weights 1.2 0.5 1 | 1.2 0.5 0
    torch.testing.assert_close(weights, torch.tensor([[1.2, 0.5, 1.0], [1.2, 0.5, 0.0]]))
    loss = corrected_policy_loss(new, new.detach(), adv, mask, weights)
    # PPO ratio 1 everywhere: -(1.2 + 0.5 + 1.0 - 2 * (1.2 + 0.5)) / 5 = 0.14
    assert loss.item() == pytest.approx(0.14, abs=1e-6)


T, R, M = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"method": "ppo"}, ValueError, r"method must be one of \('tis', 'mis', 'icepop'\)"),
        ({"method": 1}, TypeError, "method must be a str"),
        ({"level": "row"}, ValueError, r"level must be one of \('token', 'sequence'\)"),
        ({"level": None}, TypeError, "level must be a str"),
        ({"method": "icepop", "level": "sequence"}, ValueError, "level must be 'token' for method='icepop'"),
        ({"method": "mis", "clip": 2.0}, ValueError, "clip does not apply to method='mis'"),
        ({"low": 0.5}, ValueError, "low does not apply to method='tis'"),
        ({"keep": "one"}, ValueError, "keep does not apply to method='tis'"),
        ({"clip": 0.0}, ValueError, "clip must be > 0"),
        ({"clip": math.inf}, ValueError, "clip must be finite"),
        ({"clip": NAN}, ValueError, "clip must be finite"),
        ({"clip": "2"}, TypeError, "clip must be a real number"),
        ({"clip": True}, TypeError, "clip must be a real number"),
        ({"method": "mis", "low": -0.1}, ValueError, "0 <= low < high"),
        ({"method": "mis", "low": 2.0, "high": 1.0}, ValueError, "0 <= low < high"),
        ({"method": "mis", "low": 1.0, "high": 1.0}, ValueError, "0 <= low < high"),
        ({"method": "icepop", "high": math.inf}, ValueError, "high must be finite"),
        ({"method": "mis", "high": None, "low": [1]}, TypeError, "low must be a real number"),
        ({"method": "mis", "keep": "rho"}, ValueError, r"keep must be one of \('ratio', 'one'\)"),
        ({"trainer_logprobs": [[0.0]]}, TypeError, "trainer_logprobs must be a torch.Tensor"),
        ({"rollout_logprobs": torch.zeros(2, 3, dtype=torch.long)}, TypeError, "rollout_logprobs must be a float"),
        ({"trainer_logprobs": torch.zeros(6)}, ValueError, r"trainer_logprobs must be \[B, R\]"),
        ({"rollout_logprobs": torch.zeros(2, 4)}, ValueError, "rollout_logprobs must have the shape of trainer_"),
        ({"mask": torch.ones(3, 3)}, ValueError, "mask must have the shape of trainer_logprobs"),
        ({"mask": torch.full((2, 3), 2)}, ValueError, "mask must hold only 0 and 1"),
        ({"mask": "all"}, TypeError, "mask must be a torch.Tensor"),
        ({"trainer_logprobs": torch.tensor([[NAN, 0, 0], [0, 0, 0]])}, ValueError, "NaN at 1 token"),
    ],
)
def test_bad_arguments_to_correction_weights(kwargs, error, match):
    args = {"trainer_logprobs": T, "rollout_logprobs": R, "mask": M, **kwargs}
    with pytest.raises(error, match=match):
        correction_weights(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"denominator": "tokens"}, ValueError, r"denominator must be one of \('mask', 'kept'\)"),
        ({"clip": 0.0}, ValueError, r"clip must be in \(0, 1\]"),
        ({"clip": 1.5}, ValueError, r"clip must be in \(0, 1\]"),
        ({"clip": None}, TypeError, "clip must be a real number"),
        ({"advantages": torch.zeros(2, 1)}, ValueError, r"advantages must be \[B\] = \(2,\)"),
        ({"advantages": torch.zeros(2, dtype=torch.long)}, TypeError, "advantages must be a floating"),
        ({"weights": torch.ones(2, 4)}, ValueError, "weights must have the shape of new_logprobs"),
        ({"weights": torch.ones(2, 3, dtype=torch.long)}, TypeError, "weights must be a floating"),
        ({"weights": torch.tensor([[1.0, -1.0, 1.0], [1, 1, 1]])}, ValueError, "finite and >= 0"),
        ({"weights": torch.tensor([[1.0, NAN, 1.0], [1, 1, 1]])}, ValueError, "finite and >= 0"),
        ({"old_logprobs": torch.zeros(3, 3)}, ValueError, "old_logprobs must have the shape of new_logprobs"),
        ({"new_logprobs": torch.zeros(2, 3, 1)}, ValueError, r"new_logprobs must be \[B, R\]"),
        ({"mask": torch.full((2, 3), 0.5)}, ValueError, "mask must hold only 0 and 1"),
        ({"weights": None}, TypeError, "weights must be a torch.Tensor"),
    ],
)
def test_bad_arguments_to_corrected_policy_loss(kwargs, error, match):
    args = {"new_logprobs": T, "old_logprobs": R, "advantages": torch.zeros(2), "mask": M, "weights": torch.ones(2, 3)}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        corrected_policy_loss(**args)
