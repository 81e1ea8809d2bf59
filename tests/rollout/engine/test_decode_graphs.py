"""Decode graphs: bucket bookkeeping, padding rows, and the padded graph-shaped
step checked against the eager path and transformers ("eager" mode runs it on
any device; "cuda" captures it and runs where a GPU is present)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.engine.decode_graphs import DecodeGraphs, GraphKey, bucket_for, buckets, resolve_mode, row_buckets
from rollout.engine.sampler import SamplerFlags
from tests.conftest import make_engine
from tests.factories import hf_logprobs
from workspace import InferenceWorkspace, WorkspaceShape

PROMPTS = [list(range(3, 3 + k)) for k in (5, 9, 17, 30, 6)]
MIXED = [
    SamplingParams(n=3, max_tokens=20, seed=1, stop_token_ids=list(range(40, 60)), logprobs_mode="raw"),
    SamplingParams(n=2, max_tokens=14, seed=2, top_k=20, top_p=0.9, ignore_eos=True),
    SamplingParams(n=1, max_tokens=9, temperature=0.0, ignore_eos=True, top_logprobs=3),  # served by graphs too
]


def test_width_buckets_are_powers_of_two_and_batch_buckets_every_8_rows():
    assert buckets(1) == (1,)
    assert buckets(6) == (1, 2, 4, 6)
    assert buckets(8) == (1, 2, 4, 8)
    assert bucket_for(3, buckets(6)) == 4 and bucket_for(5, buckets(6)) == 6 and bucket_for(7, buckets(6)) is None
    assert row_buckets(1) == (1,) and row_buckets(3) == (1, 2, 3) and row_buckets(6) == (1, 2, 4, 6)
    assert row_buckets(8) == (1, 2, 4, 8) and row_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert row_buckets(256) == (1, 2, 4, *range(8, 257, 8))
    sizes = row_buckets(256)
    assert [bucket_for(n, sizes) for n in (3, 5, 9, 17, 129, 250)] == [4, 8, 16, 24, 136, 256]


def test_modes_resolve_per_device():
    cpu = torch.device("cpu")
    assert resolve_mode("off", cpu) == "off" and resolve_mode("eager", cpu) == "eager"
    assert resolve_mode("auto", cpu) == "off" and resolve_mode("auto", torch.device("cuda")) == "cuda"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_mode("cuda", cpu)
    with pytest.raises(ValueError, match=r"one of \('auto', 'off', 'eager', 'cuda'\)"):
        resolve_mode("always", cpu)


def test_the_default_captures_on_cuda_only(qwen2):
    assert make_engine(qwen2.path).config.decode_graphs == "off"
    if torch.cuda.is_available():  # pragma: no cover - GPU machines only
        assert make_engine(qwen2.path, device="cuda").config.decode_graphs == "cuda"


def test_bad_decode_graphs_argument_is_refused(qwen2):
    with pytest.raises(ValueError, match="decode_graphs"):
        make_engine(qwen2.path, decode_graphs="sometimes")
    with pytest.raises(TypeError, match="decode_graphs"):
        make_engine(qwen2.path, decode_graphs=True)


def test_padding_rows_write_only_to_the_scratch_page():
    ws = InferenceWorkspace(WorkspaceShape(64, 8, 6), "cpu")
    for name in ("slot_mapping", "context_lens", "temperature", "logit_rows"):
        ws.buffer(name).fill_(7)
    ws.buffer("block_tables").fill_(5)
    graphs = DecodeGraphs("eager", ws, lambda key: None, scratch_page=30, page_size=16)
    plain, filtered = SamplerFlags(False, False, False), SamplerFlags(True, False, False)
    key = graphs.key(3, 2, plain)
    assert key == GraphKey(4, 2, plain) and hash(key) == hash(GraphKey(4, 2, SamplerFlags(False, False, False)))
    assert graphs.key(3, 3, filtered) == GraphKey(4, 4, filtered) != GraphKey(4, 4, plain)
    assert graphs.key(9, 1, plain) is None  # beyond max_rows: the eager path serves it
    graphs.run(3, key)
    assert ws.buffer("slot_mapping")[3:4].tolist() == [30 * 16]
    assert ws.buffer("context_lens")[3:4].tolist() == [1]
    assert ws.buffer("temperature")[3:4].tolist() == [1.0]
    assert ws.buffer("logit_rows")[:4].tolist() == [7, 7, 7, 3]
    assert ws.buffer("block_tables")[3].tolist() == [30] * 6  # every column: wider buckets stay covered
    assert ws.buffer("block_tables")[:3].unique().tolist() == [5]  # real rows untouched; past their width, masked
    assert ws.buffer("slot_mapping")[:3].tolist() == [7, 7, 7]
    assert ws.buffer("slot_mapping")[4:8].tolist() == [7] * 4 and graphs.replays == 1
    ws.buffer("slot_mapping")[3] = 99  # same shape again: the padding is still in place, not rewritten
    graphs.run(3, key)
    assert ws.buffer("slot_mapping")[3].item() == 99
    graphs.invalidate()  # a step of another shape wrote the workspace
    graphs.run(3, key)
    assert ws.buffer("slot_mapping")[3].item() == 30 * 16 and graphs.replays == 3


def _run(engine: Engine):
    return [engine.generate(PROMPTS, p) for p in MIXED]


def _flatten(runs):
    return [
        (o.prompt_token_ids, s.token_ids, s.logprobs, s.top_logprobs) for outs in runs for o in outs for s in o.samples
    ]


def _assert_same(graphs, eager, atol=1e-5):
    assert len(graphs) == len(eager)
    for (p1, t1, l1, top1), (p2, t2, l2, top2) in zip(graphs, eager, strict=True):
        assert p1 == p2 and t1 == t2
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), atol=atol, rtol=0)
        assert (top1 is None) == (top2 is None)
        for a, b in zip(top1 or (), top2 or (), strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            torch.testing.assert_close(
                torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]), atol=atol, rtol=0
            )


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # "torch": the ops a CUDA engine runs (gathered pages, SDPA)
def test_padded_graph_steps_match_the_eager_path_and_transformers(qwen2, kernels):
    eager = make_engine(qwen2.path, max_batch_size=12, kernels=kernels)
    graphed = make_engine(
        qwen2.path, max_batch_size=12, kernels=kernels, decode_graphs="eager", debug_decode_cache=True
    )
    runs = _run(graphed)
    _assert_same(_flatten(runs), _flatten(_run(eager)))
    stats = graphed.stats()
    assert stats["decode_graph_replays"] > 20 and stats["decode_cache_hits"] > 0
    # Every pure decode fits a bucket (rows 1, 2, 4, 8, 12), top logprobs included: only prefills run eagerly.
    log = graphed.step_log()
    assert stats["decode_graph_replays"] == sum(info.graph for info in log)
    assert stats["decode_graph_eager_steps"] == len(log) - stats["decode_graph_replays"] > 0
    assert stats["decode_graph_eager_decodes"] == 0
    assert runs[2][0].samples[0].top_logprobs is not None
    raw = runs[0]  # logprobs_mode="raw": plain log-softmax of the model, comparable to transformers
    for out in raw:
        for s in out.samples:
            ref = hf_logprobs(qwen2.hf, out.prompt_token_ids, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_graph_steps_serve_weight_updates(qwen2):
    graphed = make_engine(qwen2.path, max_batch_size=12, decode_graphs="eager")
    before = _flatten(_run(graphed))
    state = {k: v * 1.5 for k, v in qwen2.hf.state_dict().items() if "mlp" in k}
    graphed.update_weights(state)
    eager = make_engine(qwen2.path, max_batch_size=12)
    eager.update_weights(state)
    runs = _run(graphed)
    after = _flatten(runs)
    assert [t for _, t, _, _ in after] != [t for _, t, _, _ in before]
    _assert_same(after, _flatten(_run(eager)))
    updated = copy.deepcopy(qwen2.hf)  # the independent reference: transformers with the pushed weights
    updated.load_state_dict(state, strict=False)
    for out in runs[0]:  # logprobs_mode="raw"
        for s in out.samples:
            ref = hf_logprobs(updated, out.prompt_token_ids, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_the_eager_path_on_the_gpu(qwen2):  # pragma: no cover - GPU machines only
    kwargs = dict(device="cuda", max_batch_size=12)
    padded = make_engine(qwen2.path, decode_graphs="eager", **kwargs)  # the same padded steps, not captured
    plain = make_engine(qwen2.path, decode_graphs="off", **kwargs)
    graphed = make_engine(qwen2.path, decode_graphs="cuda", **kwargs)
    runs = _flatten(_run(graphed))
    _assert_same(runs, _flatten(_run(padded)), atol=0)
    _assert_same(runs, _flatten(_run(plain)), atol=1e-4)  # other GEMM shapes: rounding only
    stats = graphed.stats()
    assert stats["decode_graphs_captured"] > 0 and stats["decode_graph_capture_failures"] == 0
    state = {k: v * 1.5 for k, v in qwen2.hf.state_dict().items() if "mlp" in k}
    graphed.update_weights(state)  # graphs read the live parameters, updated in place
    plain.update_weights(state)
    _assert_same(_flatten(_run(graphed)), _flatten(_run(plain)), atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_capture_is_served_eagerly_on_this_threads_stream(qwen2):  # pragma: no cover - GPU machines only
    kwargs = dict(device="cuda", max_batch_size=12)
    plain = make_engine(qwen2.path, decode_graphs="off", **kwargs)
    graphed = make_engine(qwen2.path, decode_graphs="cuda", **kwargs)
    forward = graphed.stepper.graphs._forward

    def syncs_under_capture(key):
        if torch.cuda.is_current_stream_capturing():
            graphed.workspace.buffer("positions").sum().item()  # a host sync: capture refuses it
        forward(key)

    graphed.stepper.graphs._forward = syncs_under_capture
    stream = torch.cuda.current_stream()
    with pytest.warns(UserWarning, match="could not be captured"):
        runs = _flatten(_run(graphed))
    assert torch.cuda.current_stream() == stream
    stats = graphed.stats()
    assert stats["decode_graphs_captured"] == 0 and stats["decode_graph_capture_failures"] > 0
    _assert_same(runs, _flatten(_run(plain)), atol=1e-4)


def test_a_mixed_step_between_padded_steps_does_not_leave_stale_padding(qwen2):
    """A prompt joins between two 3-row graph steps (bucket 4): its prefill step
    writes rows the padding used, which must be laid out again."""
    main = SamplingParams(n=3, max_tokens=30, seed=7, ignore_eos=True, logprobs_mode="raw")
    joiner = SamplingParams(n=1, max_tokens=1, seed=9, ignore_eos=True)

    def outputs(engine, join: bool):
        joined = []

        def callback(info):
            if join and not joined and info.num_sampled == 3 and engine.stats()["decode_graph_replays"] >= 2:
                joined.append(engine.generate([[11, 12]], joiner))  # one mixed step, then done

        engine._step_callback = callback
        out = engine.generate([[3, 4, 5, 6, 7]], main)
        return [(s.token_ids, s.logprobs) for s in out[0].samples], bool(joined)

    reference, _ = outputs(make_engine(qwen2.path, max_batch_size=4), join=False)
    graphed, joined = outputs(make_engine(qwen2.path, max_batch_size=4, decode_graphs="eager"), join=True)
    assert joined
    for (t1, l1), (t2, l2) in zip(graphed, reference, strict=True):
        assert t1 == t2
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), atol=1e-5, rtol=0)
