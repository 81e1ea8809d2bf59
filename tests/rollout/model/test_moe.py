"""Mixture-of-experts families (qwen3_moe, mixtral) against transformers'
Qwen3MoeForCausalLM and MixtralForCausalLM on the same checkpoints: greedy
tokens and teacher-forced logprobs on each kernel path, checkpoint names,
and pushes of one expert, of the routers only and of transformers' own
fused expert tensors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rollout import SamplingParams
from rollout.model import ModelConfig
from tests.conftest import make_engine
from tests.factories import MOE_FAMILIES, CountingOps, hf_logprobs, with_pushes

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(3, 28))]
RAW = SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=5, logprobs_mode="raw")
ONE = SamplingParams(max_tokens=8, ignore_eos=True, seed=5, logprobs_mode="raw")  # pushes: one sample a prompt


def _max_error(hf, outs) -> float:
    worst = 0.0
    for out in outs:
        for s in out.samples:
            ref = hf_logprobs(hf, out.prompt_token_ids, s.token_ids)
            worst = max(worst, (ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def test_config_reads_sparse_layers(moe_checkpoints):
    qwen = ModelConfig.from_dir(moe_checkpoints["qwen3_moe"].path).moe
    assert (qwen.num_experts, qwen.top_k, qwen.intermediate_size) == (8, 2, 32)
    assert qwen.sparse_layers == (True, False, True) and qwen.moe_index == (0, None, 1)
    assert not qwen.norm_topk_prob and qwen.weights_in_model_dtype
    mixtral = ModelConfig.from_dir(moe_checkpoints["mixtral"].path).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.sparse_layers) == (6, 2, (True, True))
    assert mixtral.norm_topk_prob and not mixtral.weights_in_model_dtype


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be an integer in 1..8"),
        ({"mlp_only_layers": [0, 1, 2]}, "leave no sparse"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers must be a list of layer indices in 0..2"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"num_local_experts": 0}, "num_local_experts must be an integer in 1..32768"),
    ],
)
def test_bad_moe_config_fields_are_named(moe_checkpoints, changes, needle):
    raw = json.loads((moe_checkpoints["qwen3_moe"].path / "config.json").read_text())
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**raw, **changes})


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logprobs_and_greedy_tokens_match_transformers(moe_checkpoints, family, kernels):
    ck = moe_checkpoints[family]
    engine = make_engine(ck.path, kernels=kernels)
    assert _max_error(ck.hf, engine.generate(PROMPTS, RAW)) < 1e-5
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for out in engine.generate(PROMPTS, greedy):
        ids = torch.tensor([out.prompt_token_ids])
        ref = ck.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert out.samples[0].token_ids == ref[0, len(out.prompt_token_ids) :].tolist()


# qwen3_moe: q/k norms and a dense layer between sparse ones; n: 9 rows a step, or 1 (skinny_linear's
# projections beside the sparse layers)
@pytest.mark.parametrize("family,n", [("qwen3_moe", 3), ("mixtral", 3), ("qwen3_moe", 1)])
def test_decode_layers_op_runs_sparse_layers_bit_for_bit_as_the_layer_loop(moe_checkpoints, family, n):
    """Pure-decode steps of a mixture-of-experts model run every layer in one op
    (`decode_layers` calling `moe_block`), with the same tokens, logprobs and routed
    experts (written to the pages at each token's slot) as the Python loop."""
    params = SamplingParams(n=n, max_tokens=12, ignore_eos=True, seed=3, return_routed_experts=True)
    prompts = [p[: 3 + n] for p in (*PROMPTS, list(range(40, 60)))][: 3 if n > 1 else 1]
    results, calls = {}, {}
    for one_op in (True, False):
        engine = make_engine(moe_checkpoints[family].path)
        engine.model._one_op &= one_op
        engine.model._cpu = counting = CountingOps(engine.model._cpu)
        outs = engine.generate(prompts, params)
        results[one_op] = [
            (s.token_ids, s.logprobs, out.prompt_routed_experts.tolist(), s.routed_experts.tolist())
            for out in outs
            for s in out.samples
        ]
        calls[one_op] = counting.calls["decode_layers"]
    assert results[True] == results[False]
    assert calls == {True: params.max_tokens - 1, False: 0}  # the first step prefills


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_triton_kernels_run_the_sparse_block(moe_checkpoints, family):
    ck = moe_checkpoints[family]
    engine = make_engine(ck.path, kernels="triton")
    outs = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True, seed=2, logprobs_mode="raw"))
    assert _max_error(ck.hf, outs) < 1e-5


def _expert_names(family: str, layer: int, expert: int) -> dict[str, str]:
    """Checkpoint names of one expert's gate, up and down projections."""
    if family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return {"gate": p + "w1.weight", "up": p + "w3.weight", "down": p + "w2.weight"}
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {k: p + f"{k}_proj.weight" for k in ("gate", "up", "down")}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_push_of_one_expert_by_checkpoint_names(moe_checkpoints, family):
    ck = moe_checkpoints[family]
    engine = make_engine(ck.path)
    experts = ck.hf.model.layers[0].mlp.experts
    inter = experts.down_proj.shape[2]
    g = torch.Generator().manual_seed(4)
    new = {k: 0.3 * torch.randn(shape, generator=g) for k, shape in (("gate", (inter, 64)), ("up", (inter, 64)))}
    new["down"] = 0.3 * torch.randn(64, inter, generator=g)
    hf = copy.deepcopy(ck.hf)
    with torch.no_grad():  # transformers' fused layout: gate then up along dim 1
        e = hf.model.layers[0].mlp.experts
        e.gate_up_proj[1].copy_(torch.cat([new["gate"], new["up"]]))
        e.down_proj[1].copy_(new["down"])
    names = _expert_names(family, 0, 1)
    assert engine.update_weights({names[k]: v for k, v in new.items()}) == 1
    after = engine.generate(PROMPTS, ONE)
    assert _max_error(hf, after) < 1e-5
    assert _max_error(ck.hf, after) > 1e-3  # the pushed expert took part


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_push_of_routers_only_and_of_fused_expert_tensors(moe_checkpoints, family):
    ck = moe_checkpoints[family]
    engine = make_engine(ck.path)
    hf = copy.deepcopy(ck.hf)
    g = torch.Generator().manual_seed(6)
    state = hf.state_dict()
    routers = {n: torch.randn(p.shape, generator=g) for n, p in state.items() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 2
    hf = with_pushes(hf, routers)
    engine.update_weights(routers)
    flipped = engine.generate(PROMPTS, ONE)
    assert _max_error(hf, flipped) < 1e-5 and _max_error(ck.hf, flipped) > 1e-3
    # The names transformers' modules carry: what a trainer's state_dict() pushes.
    fused = {n: t + 0.05 for n, t in hf.state_dict().items() if ".mlp.experts." in n}
    assert sorted({n.rsplit(".", 1)[1] for n in fused}) == ["down_proj", "gate_up_proj"]
    engine.update_weights(fused)
    assert _max_error(with_pushes(hf, fused), engine.generate(PROMPTS, ONE)) < 1e-5


def test_checkpoint_with_fused_expert_tensors_loads(moe_checkpoints, tmp_path):
    from safetensors.torch import save_file

    ck = moe_checkpoints["qwen3_moe"]
    state = {n: t.contiguous() for n, t in ck.hf.state_dict().items() if n != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ck.path / "config.json").read_text())
    assert _max_error(ck.hf, make_engine(tmp_path).generate(PROMPTS, RAW)) < 1e-5
    del state["model.layers.2.mlp.experts.down_proj"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.down_proj"):
        make_engine(tmp_path)


def _float64_block(x, block, moe):
    """The sparse block in float64, token by token and expert by expert (no grouping)."""
    e, inter, h = moe.num_experts, moe.intermediate_size, x.shape[1]
    xd, gate_up = x.double(), block.experts_gate_up.double().view(e, 2 * inter, h)
    down = block.experts_down.double().view(e, h, inter)
    probs = torch.softmax(xd @ block.router.double().T, dim=-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for w, ex in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (gate_up[ex] @ xd[t]).chunk(2)
            out[t] += w * (down[ex] @ (torch.nn.functional.silu(gate) * up))
    return out, experts


def test_grouped_gemm_experts_match_float64():
    """The CUDA path's two grouped GEMMs (`grouped_experts`, plain torch) on the CPU: every
    pair's expert output against float64, with an expert that gets no rows."""
    from rollout.model.moe import grouped_experts

    g = torch.Generator().manual_seed(4)
    gate_up, down = torch.randn(4, 2 * 16, 32, generator=g), torch.randn(4, 32, 16, generator=g)
    counts = torch.tensor([3, 0, 5, 1])
    rows = torch.randn(9, 32, generator=g)
    out = grouped_experts(rows, gate_up, down, counts)
    experts = torch.repeat_interleave(torch.arange(4), counts)
    for j, e in enumerate(experts.tolist()):
        gate, up = (gate_up[e].double() @ rows[j].double()).chunk(2)
        ref = down[e].double() @ (torch.nn.functional.silu(gate) * up)
        assert (out[j].double() - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "norm"),
    [(1, 5, 3, 37, 13, True), (100, 5, 3, 37, 13, False), (64, 16, 4, 64, 24, True)],
)
def test_whole_layer_op_matches_float64_at_any_shape(tokens, experts, top_k, hidden, inter, norm):
    """`moe_block` (router, top-k, experts and combine in one op) against a float64
    recompute and against the per-expert loop of torch GEMMs, at one and two threads:
    widths that are no multiple of the kernel's 8 lanes or 3 x 4 tiles, experts with no
    token and with more rows than one work item (48)."""
    from rollout.kernels.build import cpu_ops
    from rollout.kernels.layer_ops import CompiledOps
    from rollout.model.moe import sparse_mlp
    from rollout.model.moe_config import MoeConfig

    ops = CompiledOps(cpu_ops())
    moe = MoeConfig(experts, top_k, inter, norm, (True,), True)
    g = torch.Generator().manual_seed(tokens + hidden)
    block = torch.nn.Module()
    block.router = torch.randn(experts, hidden, generator=g)
    block.experts_gate_up = torch.randn(experts * 2 * inter, hidden, generator=g) * 0.2
    block.experts_down = torch.randn(experts * hidden, inter, generator=g) * 0.2
    x = torch.randn(tokens, hidden, generator=g) + 0.5 * block.router[0]  # expert 0 gets most tokens
    ref, ref_experts = _float64_block(x, block, moe)
    loop, _ = sparse_mlp(x, block, moe, None)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                out, chosen = ops.moe_block(x, block.router, block.experts_gate_up, block.experts_down, top_k, norm)
            assert torch.equal(chosen, ref_experts)
            assert (out.double() - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])  # each value is one thread's work, summed in a fixed order
    assert torch.allclose(outs[0], loop, atol=1e-5, rtol=1e-5)
    counts = torch.bincount(ref_experts.flatten(), minlength=experts)
    if tokens == 100:
        assert counts.max() > 48
    if tokens == 1:
        assert (counts == 0).any()
    with pytest.raises(RuntimeError, match=rf"top_k must be in 1\.\.{experts}, got {experts + 1}"):
        ops.moe_block(x, block.router, block.experts_gate_up, block.experts_down, experts + 1, norm)
    with pytest.raises(RuntimeError, match=r"down \[E \* H, I\]"):
        ops.moe_block(x, block.router, block.experts_gate_up, block.experts_down[1:], top_k, norm)
