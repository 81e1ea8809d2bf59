"""bfloat16 projections under a float32 model (`matmul_dtype="bfloat16"`).

A projection against a float64 recompute of the same rounding (weights,
biases and inputs rounded to bfloat16, the output rounded as the GEMM writes
it), on oneDNN and on torch's fallback GEMM, with stale and packed copies;
skinny_linear_bf16 likewise; the one-op decode path bit for bit against the
Python layer loop; the engine's logprobs against transformers with the same
rounding (its projections replaced on a copy of the reference) and against
float32, on every family and both kernel paths, also after a weight push;
and the copies' dtypes. Bad values and the command-line flag are tested with
the KV option's, in test_kv_cache_dtype.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout import SamplingParams
from rollout.kernels.build import cpu_ops
from rollout.model import decoder
from rollout.model.linear import onednn_bf16 as onednn_bf16_here
from tests.conftest import make_engine
from tests.factories import FAMILIES, hf_logprobs

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def bf16_matmul_reference(model):
    """A copy of the transformers `model` whose layer projections compute the float64 product
    of their bfloat16-rounded input, weight and bias, rounded to bfloat16: the exact result
    the engine's GEMMs round, whatever the row count (a float32 product's last bits, and so
    its rounding, depend on how the GEMM blocks its rows). The LM head, the embeddings,
    norms and attention stay float32."""

    def rounded(weight, bias):
        return lambda x: F.linear(_round(x).double(), weight, bias).float().bfloat16().float()

    out = copy.deepcopy(model)
    for name, module in out.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            bias = None if module.bias is None else _round(module.bias).double()
            module.forward = rounded(_round(module.weight).double(), bias)
    return out


PROMPTS = [list(range(3, 3 + k)) for k in (5, 23, 40)]
PARAMS = SamplingParams(n=2, max_tokens=30, seed=1, ignore_eos=True)


def _mean_distances(engine, hf, ref, prompts, params) -> tuple[float, float]:
    """Mean |logprob difference| of the engine's sampled tokens to `ref` and to `hf`."""
    to_reference, to_float32 = [], []
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        for sample in out.samples:
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            to_reference.append((got - hf_logprobs(ref, prompt, sample.token_ids)).abs())
            to_float32.append((got - hf_logprobs(hf, prompt, sample.token_ids)).abs())
    return torch.cat(to_reference).mean().item(), torch.cat(to_float32).mean().item()


@pytest.fixture(params=[True, False], ids=["onednn", "torch_gemm"])
def onednn_bf16(request, monkeypatch):
    """Both GEMM paths of the bfloat16 projections: oneDNN's where this CPU runs
    it, and torch's F.linear, which CPUs without oneDNN's bfloat16 GEMMs take."""
    if request.param and not onednn_bf16_here():
        pytest.skip("oneDNN has no bfloat16 GEMM on this CPU; the torch_gemm case covers the path it takes")
    monkeypatch.setattr(decoder, "onednn_bf16", lambda: request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_projection_rounds_as_a_float64_recompute(qwen2, onednn_bf16, rows):
    """Each output is the bfloat16 rounding of the exact sum of bfloat16 products (plus the
    rounded bias), up to float32 accumulation: at most one bfloat16 step off, and exact almost
    everywhere; with the stale copy (the live weight converted at use) and the packed one."""
    engine = make_engine(qwen2.path, matmul_dtype="bfloat16")
    model = engine.model
    assert model._narrow_onednn == onednn_bf16 and model._skinny(1)  # one row: skinny_linear_bf16
    name, weight = model._projections[1][0]  # layer 1's qkv, with its bias
    bias = model.layers[1].qkv_bias
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
    exact = _round(x).double() @ _round(weight).double().T + _round(bias).double()
    expected = exact.float().bfloat16().float()
    model.packed.changed()
    for state in ("stale", "current"):
        got = model._project(x, name, weight, bias)
        assert got.dtype == torch.float32, state
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-30, msg=state)
        assert (got == expected).double().mean() > 0.995, state
        while model.packed.num_current < len(model.packed.names):
            model.packed.start_step()


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("k", [64, 100])  # 100: a tail past the 32-lane blocks
def test_skinny_linear_bf16_rounds_as_a_float64_recompute(rows, k):
    """x, the float32 weight and the bias rounded to bfloat16 as read, the output as written:
    within one bfloat16 step of the rounded float64 result, and equal to it almost everywhere."""
    g = torch.Generator().manual_seed(rows * 100 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(300, k, generator=g), torch.randn(300, generator=g)
    exact = _round(x).double() @ _round(w).double().T + _round(b).double()
    expected = exact.float().bfloat16().float()
    got = cpu_ops().skinny_linear_bf16(x, w, b)
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # bfloat16 values
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-30)
    assert (got == expected).double().mean() > 0.99


@pytest.mark.parametrize("family", ["qwen2", "mistral"])  # qwen2: biases; mistral: sliding window
@pytest.mark.parametrize("n", [3, 1])
def test_decode_layers_op_equals_the_python_layer_loop(checkpoints, family, n):
    """Where oneDNN multiplies bfloat16, pure-decode steps run every layer in one op, bit for
    bit as the Python loop, one-row steps included; elsewhere the loop runs them."""
    params = SamplingParams(n=n, max_tokens=20, seed=5, ignore_eos=True)
    prompts = [list(range(3, 3 + k)) for k in (4, 19, 33)][: 3 if n == 3 else 1]
    results = {}
    for one_op in (True, False):
        engine = make_engine(checkpoints[family].path, matmul_dtype="bfloat16")
        assert engine.model._one_op == onednn_bf16_here()
        engine.model._one_op &= one_op
        results[one_op] = [(s.token_ids, s.logprobs) for out in engine.generate(prompts, params) for s in out.samples]
    assert results[True] == results[False]


@pytest.mark.parametrize("family", FAMILIES)  # qwen2: biases; qwen3: q/k norms (the Python layer loop)
def test_engine_logprobs_match_transformers_with_the_same_rounding(checkpoints, family, onednn_bf16):
    """Both kernel paths, many rows and one. A bfloat16 rounding is a step function: where the
    engine's float32 value and the reference's (computed in another order) straddle a
    rounding boundary, one element moves by a bfloat16 step, which in these 64-wide models
    moves later logprobs by up to 1e-2 (the reference's own logprobs for llama here move
    by 5e-3 between two attention kernels). So the check is on the mean over the samples:
    at most 1/2.5 of the distance to float32 (what the option costs); measured here, the
    distance to the reference is 1/4 (llama, qwen3) to 1/20000 of it."""
    hf = checkpoints[family].hf
    ref = bf16_matmul_reference(hf)
    one_row = SamplingParams(max_tokens=20, seed=2, ignore_eos=True)
    for kernels in ("compiled", "torch"):
        engine = make_engine(checkpoints[family].path, kernels=kernels, matmul_dtype="bfloat16")
        assert engine.config.kernels == kernels and engine.config.matmul_dtype == torch.bfloat16
        for prompts, params in ((PROMPTS, PARAMS), (PROMPTS[1:2], one_row)):
            to_reference, to_float32 = _mean_distances(engine, hf, ref, prompts, params)
            assert 2.5 * to_reference < to_float32, (kernels, to_reference, to_float32)
            assert to_float32 > 1e-3  # bfloat16 rounding happened


def test_the_copies_are_bfloat16_and_the_weights_stay_float32(qwen2, onednn_bf16):
    engine = make_engine(qwen2.path, matmul_dtype=torch.bfloat16)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True))  # enough steps to pack every copy
    model = engine.model
    assert model.packed.num_current == len(model.packed.names)
    for name, param in model._projections[0]:
        assert param.dtype == torch.float32 and model._weight(name, param).dtype == torch.bfloat16
    head, weight = model._head
    assert model._weight(head, weight).dtype == torch.float32  # the logits stay float32
    assert engine.kv_pool.k.dtype == torch.float32


def test_a_weight_push_serves_the_new_weights_rounded_alike(qwen2, onednn_bf16):
    """Right after a push the new weights' copies are stale and the GEMMs convert the live
    weights at each use; within 32 steps they are repacked. Both are rounded alike."""
    engine = make_engine(qwen2.path, matmul_dtype="bfloat16")
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True))
    new_hf = copy.deepcopy(qwen2.hf)
    with torch.no_grad():
        for name, param in new_hf.named_parameters():
            if "mlp" in name or "o_proj" in name:
                param.mul_(1.5)
    engine.update_weights(new_hf.state_dict())
    assert engine.model.packed.num_current < len(engine.model.packed.names)  # stale until the next steps
    to_reference, to_float32 = _mean_distances(engine, new_hf, bf16_matmul_reference(new_hf), PROMPTS, PARAMS)
    assert engine.model.packed.num_current == len(engine.model.packed.names)
    assert 2.5 * to_reference < to_float32, (to_reference, to_float32)
