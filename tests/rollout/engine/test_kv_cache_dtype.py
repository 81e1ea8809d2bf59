"""A bfloat16 KV pool under a float32 model (`kv_cache_dtype="bfloat16"`).

The kernels: paged decode over a bfloat16 pool against a float64 recompute
over the same (rounded) keys and values, and the rotary/KV write storing
exactly what torch's rounding to bfloat16 stores. The engine: its logprobs
against transformers with the same rounding of every key and value (an
attention function registered for the reference), on both kernel paths and
every family, and much further from the float32 reference than from that
one; the pool's bytes; and bad values refused before anything is built.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollout import SamplingParams
from rollout.cli import main, parser
from rollout.kernels.build import cpu_ops
from rollout.model.config import RopeConfig
from rollout.model.rope import RotaryTable
from tests.conftest import make_engine
from tests.factories import FAMILIES, hf_logprobs
from tests.rollout.kernels.test_cpu_kernels import random_case, reference
from workspace import KVPool

BF16_KV = "bf16_kv_reference"


def bf16_kv_reference(model):
    """A copy of the transformers `model` whose attention sees every key and value rounded to
    bfloat16 (after the rotary embedding, as the engine's pool stores them), in float32 SDPA."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        rounded = key.bfloat16().float(), value.bfloat16().float()
        return sdpa_attention_forward(module, query, *rounded, attention_mask, **kwargs)

    AttentionInterface.register(BF16_KV, attention)
    AttentionMaskInterface.register(BF16_KV, sdpa_mask)  # sliding windows masked as SDPA's
    out = copy.deepcopy(model)
    out.set_attn_implementation(BF16_KV)
    return out


@pytest.mark.parametrize(
    "rows, hq, hkv, dim, window, page_size",
    [
        (3, 4, 4, 64, 0, 4),  # few rows: heads split across threads
        (17, 8, 2, 64, 0, 4),  # whole rows per item
        (17, 6, 3, 128, 7, 4),  # sliding window, head_dim 128
        (5, 4, 2, 24, 0, 4),  # the portable loop
        (9, 14, 2, 64, 0, 16),  # long contexts: whole and partial reduction blocks, wide groups
    ],
)
def test_decode_over_a_bfloat16_pool_matches_a_float64_recompute(rows, hq, hkv, dim, window, page_size):
    q, k, v, tables, lens, out = random_case(rows, hq, hkv, dim, page_size=page_size, seed=rows + dim)
    k, v = k.bfloat16(), v.bfloat16()
    cpu_ops().paged_decode(q, k, v, tables, lens, out, dim**-0.5, window)
    expected = reference(q, k, v, tables, lens, dim**-0.5, window)  # over the rounded values
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)


def test_rope_and_cache_rounds_into_a_bfloat16_pool_as_torch_does():
    g = torch.Generator().manual_seed(4)
    tokens, hq, hkv, dim = 11, 4, 2, 64
    table = RotaryTable(RopeConfig(theta=10000.0, type="default"), dim, 64, torch.float32, "cpu")
    q = torch.randn(tokens, hq, dim, generator=g)
    k, v = torch.randn(tokens, hkv, dim, generator=g), torch.randn(tokens, hkv, dim, generator=g)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(5 * 4, generator=g)[:tokens]
    pools = [
        KVPool(num_layers=1, num_pages=5, page_size=4, num_kv_heads=hkv, head_dim=dim, dtype=dt, device="cpu")
        for dt in (torch.float32, torch.bfloat16)
    ]
    q_ref, k_ref = table.apply(q, k, positions)
    pools[0].write(0, slots, k_ref, v)
    cpu_ops().rope_and_cache_(q, k, v, positions, table.cos, table.sin, pools[1].k[0], pools[1].v[0], slots)
    assert torch.equal(q, q_ref)  # q stays float32
    assert torch.equal(pools[1].k, pools[0].k.bfloat16()) and torch.equal(pools[1].v, pools[0].v.bfloat16())


def test_the_kernels_refuse_mixed_pools_before_writing():
    q, k, v, tables, lens, out = random_case(4, 4, 2, 64)
    with pytest.raises(RuntimeError, match="k_cache and v_cache either that dtype or bfloat16"):
        cpu_ops().paged_decode(q, k.bfloat16(), v, tables, lens, out, 0.125, 0)
    with pytest.raises(RuntimeError, match="k_cache and v_cache either that dtype or bfloat16"):
        cpu_ops().paged_decode(q.bfloat16(), k, v, tables, lens, out.bfloat16(), 0.125, 0)
    assert out.isnan().all()
    table = RotaryTable(RopeConfig(theta=10000.0, type="default"), 8, 64, torch.float32, "cpu")
    q, k, v = torch.ones(2, 2, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8)
    k_cache, v_cache = torch.zeros(5, 4, 1, 8, dtype=torch.bfloat16), torch.zeros(5, 4, 1, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU tensors alike"):
        cpu_ops().rope_and_cache_(
            q, k, v, torch.tensor([0, 1]), table.cos, table.sin, k_cache, v_cache, torch.tensor([0, 1])
        )
    assert torch.equal(q, torch.ones(2, 2, 8)) and not k_cache.any()


@pytest.mark.parametrize("family", FAMILIES)  # qwen3: q/k norms; mistral: sliding window, head_dim 32
def test_engine_logprobs_match_transformers_with_the_same_rounding(checkpoints, family):
    """Both kernel paths, with shared prompt pages and preemption (recomputed KV is rounded
    again, identically): within float32 noise of the bfloat16-KV reference, and at least ten
    times further from the float32 one (what the option costs)."""
    hf = checkpoints[family].hf
    ref = bf16_kv_reference(hf)
    prompts = [list(range(3, 3 + k)) for k in (5, 23, 40)]
    params = SamplingParams(n=2, max_tokens=30, seed=1, ignore_eos=True)
    for kernels in ("compiled", "torch"):
        engine = make_engine(checkpoints[family].path, kernels=kernels, kv_cache_dtype="bfloat16", kv_cache_tokens=160)
        assert engine.kv_pool.k.dtype == engine.kv_pool.v.dtype == torch.bfloat16
        assert engine.config.kernels == kernels
        outputs = engine.generate(prompts, params)
        assert engine.stats()["preemptions"] > 0
        to_reference = to_float32 = 0.0
        for prompt, out in zip(prompts, outputs, strict=True):
            for sample in out.samples:
                got = torch.tensor(sample.logprobs, dtype=torch.float64)
                to_reference = max(to_reference, (got - hf_logprobs(ref, prompt, sample.token_ids)).abs().max().item())
                to_float32 = max(to_float32, (got - hf_logprobs(hf, prompt, sample.token_ids)).abs().max().item())
        # A key whose float32 value lies on a bfloat16 rounding boundary may round the other way
        # here than in the reference (the rotary embedding differs by float32 rounding): 3e-4.
        assert to_reference < 3e-4, (kernels, to_reference)
        assert to_float32 > 10 * to_reference, (kernels, to_reference, to_float32)


def test_the_pool_holds_half_the_bytes(qwen2):
    f32 = make_engine(qwen2.path, kv_cache_tokens=1024)
    bf16 = make_engine(qwen2.path, kv_cache_tokens=1024, kv_cache_dtype=torch.bfloat16)
    assert bf16.config.kv_cache_dtype == torch.bfloat16 and f32.config.kv_cache_dtype == torch.float32
    assert bf16.kv_pool.nbytes * 2 == f32.kv_pool.nbytes
    assert bf16.model.embed.dtype == torch.float32  # the weights keep the model's dtype


@pytest.mark.parametrize("field", ["kv_cache_dtype", "matmul_dtype"])
@pytest.mark.parametrize(
    "value, dtype, error, message",
    [
        ("fp8", "float32", ValueError, "{field} must be one of"),
        (16, "float32", TypeError, "{field} must be a str or torch.dtype, got int"),
        ("float16", "float32", ValueError, r"{field} must be None or one of 'float32', 'bfloat16'"),
        ("float32", "bfloat16", ValueError, r"{field} must be None or one of 'bfloat16' for dtype torch.bfloat16"),
    ],
)
def test_bad_narrow_dtypes_are_refused_by_name(qwen2, field, value, dtype, error, message):
    """Both bfloat16 options of a float32 model (this file's and test_matmul_dtype.py's)."""
    with pytest.raises(error, match=message.format(field=field)):
        make_engine(qwen2.path, dtype=dtype, **{field: value})


@pytest.mark.parametrize("field", ["kv_cache_dtype", "matmul_dtype"])
def test_serve_and_generate_take_the_narrow_dtypes(qwen2, tmp_path, capsys, field):
    from rollout.server.run import build_backend

    flag = "--" + field.replace("_", "-")
    sizes = ["--max-seq-len", "64", "--kv-cache-tokens", "256", "--device", "cpu"]
    backend = build_backend(parser().parse_args(["serve", "--model", str(qwen2.path), *sizes, flag, "bfloat16"]))
    try:
        assert getattr(backend.engine.config, field) == torch.bfloat16
        assert (backend.engine.kv_pool.k.dtype == torch.bfloat16) == (field == "kv_cache_dtype")
    finally:
        backend.close()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n")
    argv = ["generate", "--model", str(qwen2.path), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]
    assert main([*argv, *sizes, "--quiet", flag, "fp8"]) == 2
    assert f"{field} must be one of" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
