"""The engine through its Triton kernels (`kernels="triton"`), run on the CPU
under Triton's interpreter: every layer op, paged prefill and decode attention
and the device sampler, checked against transformers and the torch path, and
the kernel launches of a captured decode step counted per layer."""

from __future__ import annotations

import functools

import pytest
import torch

from rollout import SamplingParams
from rollout.kernels.launch_count import counted_launches
from rollout.kernels.triton import sampling
from tests.conftest import make_engine
from tests.factories import FAMILIES, hf_logprobs, make_checkpoint

SIZES = dict(max_batch_size=16, max_seq_len=128, kv_cache_tokens=16 * 24)
MAX_LAUNCHES_PER_LAYER = 12


def triton_engine(path, **kwargs):
    return make_engine(path, kernels="triton", **{**SIZES, **kwargs})


@pytest.mark.parametrize("family", FAMILIES)  # qwen2: biases; qwen3: q/k norms; mistral: a sliding window
def test_triton_engine_matches_transformers_and_the_torch_path(checkpoints, family):
    """Teacher-forced logprobs of the samples against transformers, and the
    same tokens and logprobs as the torch path, with prompts whose prefill
    continues a cached prefix (n=3 shares the prompt's pages) over chunks."""
    params = SamplingParams(n=2, max_tokens=8, seed=3, ignore_eos=True, logprobs_mode="raw")
    prompts = [list(range(3, 3 + k)) for k in (5, 30)]
    engine = triton_engine(checkpoints[family].path, max_step_tokens=24)  # the 30-token prompt takes two chunks
    assert engine.config.kernels == "triton" and engine.stepper.prefill_kernel is not None
    outs = engine.generate(prompts, params)
    torch_outs = make_engine(checkpoints[family].path, kernels="torch", max_step_tokens=24, **SIZES).generate(
        prompts, params
    )
    for prompt, out, theirs in zip(prompts, outs, torch_outs, strict=True):
        for sample, other in zip(out.samples, theirs.samples, strict=True):
            assert sample.token_ids == other.token_ids
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            torch.testing.assert_close(got, torch.tensor(other.logprobs, dtype=torch.float64), atol=2e-5, rtol=0)
            ref = hf_logprobs(checkpoints[family].hf, prompt, sample.token_ids)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_float16_engine_on_triton_kernels_tracks_transformers(qwen2):
    """A float16 model: the kernels round as the torch path does step by step,
    so its logprobs stay as close to transformers' float32 ones as the torch path's."""
    params = SamplingParams(n=2, max_tokens=8, seed=5, ignore_eos=True, logprobs_mode="raw")
    prompts = [list(range(4, 4 + k)) for k in (6, 19)]
    errors = {}
    for kernels in ("triton", "torch"):
        outs = make_engine(qwen2.path, kernels=kernels, dtype="float16", **SIZES).generate(prompts, params)
        diffs = [
            (torch.tensor(s.logprobs, dtype=torch.float64) - hf_logprobs(qwen2.hf, p, s.token_ids)).abs()
            for p, out in zip(prompts, outs, strict=True)
            for s in out.samples
        ]
        errors[kernels] = torch.cat(diffs).mean().item()
    assert errors["triton"] < 2 * errors["torch"] + 1e-4 and errors["triton"] < 0.02


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_decode_graphs_on_triton_kernels_need_no_width_bucket(checkpoints, family):
    """Padded graph steps read block tables at their full width: every decode
    step of any context length uses one width bucket, and the results equal
    plain steps'."""
    params = SamplingParams(n=2, max_tokens=12, seed=7, ignore_eos=True)
    prompts = [list(range(3, 3 + k)) for k in (3, 30)]  # the second crosses a page while decoding
    graphed = triton_engine(checkpoints[family].path, decode_graphs="eager")
    assert graphed.stepper.graphs.page_buckets == (graphed.workspace.shape.max_pages_per_seq,)
    outs = graphed.generate(prompts, params)
    assert graphed.stats()["decode_graph_replays"] > 0
    plain = triton_engine(checkpoints[family].path).generate(prompts, params)
    for a, b in zip(outs, plain, strict=True):
        for x, y in zip(a.samples, b.samples, strict=True):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("candidates", [sampling.CANDIDATES, 2])  # 2: most rows fall back to the full sort
def test_filtered_sampling_on_the_device_equals_the_torch_path(qwen2, candidates):
    """top-k, top-p and min-p rows sampled from candidates, and rows the
    candidates do not cover resampled with a full sort, give the torch path's
    tokens and logprobs."""
    prompts = [list(range(5, 5 + k)) for k in (4, 11)]
    for params in (
        SamplingParams(n=2, max_tokens=5, seed=9, ignore_eos=True, top_p=0.8, temperature=1.3),
        SamplingParams(n=2, max_tokens=5, seed=4, ignore_eos=True, top_k=5, min_p=0.05),
    ):
        engine = triton_engine(qwen2.path)
        resampled = _count_resampled(engine, candidates)
        outs = engine.generate(prompts, params)
        assert (resampled[0] > 0) == (candidates == 2)
        theirs = make_engine(qwen2.path, kernels="torch", **SIZES).generate(prompts, params)
        for a, b in zip(outs, theirs, strict=True):
            for x, y in zip(a.samples, b.samples, strict=True):
                assert x.token_ids == y.token_ids
                torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-5, rtol=0)


def _count_resampled(engine, candidates: int) -> list[int]:
    """Samples the engine's rows from `candidates` candidates; counts the rows sent to the full sort."""
    stepper, resample, count = engine.stepper, engine.stepper._resample_uncovered, [0]
    stepper.device_sample = functools.partial(sampling.sample, candidates=candidates)

    def counting(n: int) -> None:
        count[0] += int((~stepper.ws.view("out_covered", n)).sum())
        resample(n)

    stepper._resample_uncovered = counting
    return count


def _decode_step_launches(path, batch: int, **params) -> int:
    """Kernels launched by one padded decode step of `batch` rows, as a graph captures it."""
    engine = triton_engine(path, decode_graphs="eager")
    engine.generate([[3, 4, 5, 6]], SamplingParams(n=batch, max_tokens=3, ignore_eos=True, **params))
    stepper = engine.stepper
    key = stepper.graphs.key(batch, 1, stepper._flags)
    with counted_launches() as count:
        stepper._padded_decode(key)
    return count


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("params", [{}, {"top_p": 0.9}])
def test_a_decode_step_launches_at_most_12_kernels_per_layer(tmp_path, family, params):
    """Counted over two depths of the same model, so the per-step ops (embedding,
    final norm, LM head, sampler) cancel out; attention reads the pool in place
    (no page gather, no repeated heads, no SDPA) and sampling sorts nothing."""
    counts = {}
    for layers in (2, 4):
        path = tmp_path / f"{family}_{layers}"
        make_checkpoint(path, family, seed=1, num_hidden_layers=layers)
        counts[layers] = _decode_step_launches(path, 4, **params)
    per_layer = (counts[4].total - counts[2].total) / 2
    assert per_layer <= MAX_LAUNCHES_PER_LAYER, (counts[4].torch_ops, counts[4].triton)
    count = counts[4]
    assert count.triton["paged_decode_kernel"] == 4 and count.triton["_rope_cache_kernel"] == 4
    assert count.torch_ops["index_select"] == 1  # the sampled rows' hidden states; no page is gathered
    for name in count.torch_ops:
        assert not any(word in name for word in ("repeat", "scaled_dot_product", "index_copy", "sort")), name
