"""Adapter pushes from a PEFT LoRA model: the engine's weights and logprobs
equal PEFT's merged model after several pushes, merges never accumulate,
and a replacement loading the composed pushes holds the same weights."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from rollout import SamplingParams
from rollout.cluster.actor import RolloutWorker, weight_aliases
from rollout.cluster.published import compose
from rollout.engine.weight_lora import Adapter, merge
from tests.conftest import make_engine
from tests.factories import hf_logprobs, pack_state
from trainer_bridge import TrainerBridge
from trainer_bridge.lora import export_adapters

PROMPTS = [list(range(3, 25)), [9, 8, 7, 6, 5]]
PARAMS = SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=17, logprobs_mode="raw")
TARGETS = ["q_proj", "v_proj", "down_proj", "embed_tokens"]


def _peft_model(hf, seed: int):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    torch.manual_seed(seed)
    return peft.get_peft_model(copy.deepcopy(hf), cfg)


def _train(model, steps: int, seed: int) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 96, (4, 20), generator=g)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _merged(pm):
    return copy.deepcopy(pm).merge_and_unload().eval()


def _assert_serves(engine, merged, logprobs: bool = True):
    expected = merged.state_dict()
    for name, slot in engine.model.weight_slots().items():
        assert torch.allclose(slot.view(), expected[name], rtol=0, atol=1e-6), name
    if not logprobs:
        return
    for out in engine.generate(PROMPTS, PARAMS):
        for s in out.samples:
            ref = hf_logprobs(merged, out.prompt_token_ids, s.token_ids)
            assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=1e-5)


def test_adapter_pushes_serve_peft_s_merged_model_without_accumulating(qwen2):
    engine = make_engine(qwen2.path, kernels="torch")
    bridge = TrainerBridge(engine)
    pm = _peft_model(qwen2.hf, seed=1)
    for step in range(3):
        _train(pm, steps=1, seed=step)
        assert bridge.push(pm) == step + 1
        cost = bridge.last_push
        assert cost.encoding == "lora" and cost.bytes_sent < cost.bytes_full / 5
        assert cost.tensors == {"full": 0, "adapter": 7}  # 2 layers x 3 projections + the embedding
        _assert_serves(engine, _merged(pm), logprobs=step == 2)
    assert bridge.push(pm) == 4  # the same adapters again: merged from the kept base, not on top
    _assert_serves(engine, _merged(pm), logprobs=False)
    staged = engine.prepare_weights(export_adapters(pm))  # unchanged adapters: nothing to merge again
    assert not staged.swaps and not staged.copies
    engine.discard_weights(staged)
    lora_b = next(p for n, p in pm.named_parameters() if "layers.1.self_attn.v_proj.lora_B" in n)
    with torch.no_grad():
        lora_b.add_(0.01)
    staged = engine.prepare_weights(export_adapters(pm))  # one changed adapter: only its tensor is merged
    assert set(staged.swaps) == {"layers.1.qkv"}
    engine.discard_weights(staged)
    assert bridge.push(pm) == 5
    _assert_serves(engine, _merged(pm), logprobs=False)
    # A whole push replaces the base: later adapters merge over it.
    new_base = _merged(pm)
    assert bridge.push(new_base, delta=False) == 6
    pm2 = _peft_model(new_base, seed=2)
    _train(pm2, steps=1, seed=9)
    bridge.push(pm2)
    _assert_serves(engine, _merged(pm2))


def test_bad_adapters_are_refused_by_name(qwen2):
    engine = make_engine(qwen2.path)
    name = "model.layers.0.self_attn.q_proj.weight"
    a, b, s = torch.zeros(4, 64), torch.zeros(64, 4), torch.tensor([2.0], dtype=torch.float64)
    for state, needle in [
        ({name + "@lora.A": a, name + "@lora.B": b}, "must have"),
        ({name + "@lora.A": a, name + "@lora.B": torch.zeros(64, 3), name + "@lora.scaling": s}, "one r"),
        ({name + "@lora.A": a[:0], name + "@lora.B": b[:, :0], name + "@lora.scaling": s}, "r >= 1"),  # rank 0
        ({name + "@lora.A": torch.zeros(4, 32), name + "@lora.B": b, name + "@lora.scaling": s}, r"\(64, 32\)"),
        ({name + "@lora.A": a, name + "@lora.B": b, name + "@lora.scaling": s * float("nan")}, "finite"),
        ({"x.weight@lora.A": a, "x.weight@lora.B": b, "x.weight@lora.scaling": s}, "not a parameter"),
        ({name + "@lora.A": a + 1e20, name + "@lora.B": b + 1e20, name + "@lora.scaling": s}, "not finite"),
        (
            {
                name: torch.full((64, 64), float("nan")),
                name + "@lora.A": a,
                name + "@lora.B": b,
                name + "@lora.scaling": s,
            },
            "not finite",
        ),
    ]:
        with pytest.raises(ValueError, match=needle):
            engine.update_weights(state)
    assert engine.policy_version == 0 and not engine._updater.lora.bases


def test_a_replacement_loading_composed_adapter_pushes_holds_the_merged_weights(qwen2):
    engine_kw = dict(device="cpu", max_batch_size=8, max_seq_len=128, kv_cache_tokens=1024, kernels="torch")
    probe = make_engine(qwen2.path, **engine_kw)
    aliases = weight_aliases(probe.model.weight_slots())
    pm = _peft_model(qwen2.hf, seed=3)
    _train(pm, steps=2, seed=4)
    first = export_adapters(pm)
    # Push 2 sets one adapted tensor whole: its adapter entries from push 1 no longer apply.
    whole_name = "model.layers.1.mlp.down_proj.weight"
    whole = {whole_name: torch.randn(64, 112, generator=torch.Generator().manual_seed(5)) * 0.05}
    published = None
    for version, state in enumerate([first, whole], start=1):
        buckets, manifest = pack_state(state, 1 << 14)
        published = compose(published, manifest, version, tuple([b] for b in buckets), aliases)
    assert not any(e.name.startswith(whole_name + "@") for e in published.manifest.entries)
    worker = RolloutWorker(qwen2.path, engine_kw, None, published.manifest, published.version, *published.refs)
    expected = _merged(pm).state_dict()
    expected[whole_name] = whole[whole_name]
    for name, slot in worker.engine.model.weight_slots().items():
        assert torch.allclose(slot.view(), expected[name], rtol=0, atol=1e-6), name
    # The live engine took the same two pushes.
    probe.update_weights(first)
    probe.update_weights(whole)
    for name, slot in probe.model.weight_slots().items():
        assert torch.equal(slot.view(), worker.engine.model.weight_slots()[name].view()), name


PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _adapters(slots, seed: int, r: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for proj in PROJECTIONS[: 7 - layer]:  # layer 1: not down_proj
            name = f"model.layers.{layer}.{proj}.weight"
            rows, cols = slots[name].shape
            out[name + "@lora.A"] = torch.randn(r, cols, generator=g) * 0.1
            out[name + "@lora.B"] = torch.randn(rows, r, generator=g) * 0.1
            out[name + "@lora.scaling"] = torch.tensor([1.5], dtype=torch.float64)
    return out


def test_bf16_adapter_pushes_merge_over_the_kept_base_bit_for_bit(qwen2):
    # The engine's host path (the compiled merge into reused staging buffers, the replaced storage kept as
    # the base) against one merge of the checkpoint's own bf16 values, X, Y, a discarded Z, then X again:
    # bit for bit (no merge over a merged value, no leftover of Z) and within one bf16 rounding of float64.
    engine = make_engine(qwen2.path, dtype="bfloat16")
    slots = engine.model.weight_slots()
    before = {name: slot.view().clone() for name, slot in slots.items()}
    pushes = [_adapters(slots, seed) for seed in range(3)]
    for step, state in enumerate([pushes[0], pushes[1], None, pushes[0]]):
        if state is None:  # a push prepared and dropped changes nothing, its buffers go back
            engine.discard_weights(engine.prepare_weights(pushes[2]))
            continue
        engine.update_weights(state)
        for name, slot in slots.items():
            want = before[name]
            if name + "@lora.A" in state:
                a, b = state[name + "@lora.A"], state[name + "@lora.B"]
                want = merge(name, before[name], Adapter(a, b, 1.5))
                exact = before[name].double() + 1.5 * b.double() @ a.double()
                torch.testing.assert_close(want.double(), exact, rtol=2**-8, atol=1e-6)
                assert not torch.equal(want, before[name])
            assert torch.equal(slot.view(), want), (step, name)
    bases = engine._updater.lora.bases
    assert len(bases) == 13 and all(torch.equal(t, before[name]) for name, t in bases.items())
