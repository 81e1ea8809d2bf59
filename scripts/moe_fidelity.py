"""Rollout-vs-trainer fidelity on a small Qwen3-MoE with routing replay.

The engine samples a GRPO-shaped batch (8 prompts of 24 tokens, 4 samples
each, 48 tokens, temperature 1) with `return_routed_experts=True`; the
trainer is transformers' Qwen3MoeForCausalLM on the same checkpoint. In
bfloat16 the script reports the share of routing decisions (position and
sparse layer) whose expert set differs between the engine and the trainer's
own routers, and the logprob mismatch (`token_logprobs`' mean and max
|trainer - rollout| and k3 KL) without and with `replay_routing`. In float32
it reports the replayed mismatch, which should be float32 rounding (< 1e-5).

The model is built so its router logits are close: routers drawn at a tenth
of the other weights' scale, so the top-k edge falls between experts whose
logits differ by less than bfloat16 resolves, as in trained MoE models where
the R3 paper measured about 10% of decisions disagreeing. Otherwise the
weights are random, 4 layers of 32 experts (top 4, renormalised), hidden 256.

    python -m scripts.moe_fidelity [--threads N] [--out runs/moe_fidelity.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from scripts.bench import workload_prompts
from scripts.host import describe
from trainer_bridge import RolloutBatch, sparse_routers, token_logprobs

CONFIG = dict(
    model_type="qwen3_moe",
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)
PARAMS = SamplingParams(n=4, max_tokens=48, ignore_eos=True, seed=0, return_routed_experts=True)


def build(path: Path) -> None:
    """A float32 checkpoint of CONFIG with routers at a tenth of the other weights' scale."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG)).eval()
    with torch.no_grad():
        for router in sparse_routers(model):
            router.weight.normal_(0.0, 0.1 * CONFIG.get("initializer_range", 0.02))
    model.save_pretrained(path)


def measure(path: Path, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    engine = Engine(path, device="cpu", dtype=dtype, max_batch_size=32, max_seq_len=128, kv_cache_tokens=8192)
    outs = engine.generate(workload_prompts(8, 24, vocab=CONFIG["vocab_size"]), PARAMS)
    batch = RolloutBatch.from_outputs(outs, PARAMS, 0)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        own = _own_routing(trainer, batch)
        token_logprobs(trainer, batch)
        plain = batch.mismatch
        token_logprobs(trainer, batch, replay_routing=True)
        replayed = batch.mismatch
    recorded = batch.routed_experts
    real = recorded[..., 0] >= 0
    differ = (own.sort(-1).values != recorded.sort(-1).values).any(-1)[real]
    return {
        "decisions": int(differ.numel()),
        "differing_share": float(differ.float().mean()),
        "mismatch_without_replay": plain,
        "mismatch_with_replay": replayed,
    }


def _own_routing(model, batch) -> torch.Tensor:
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    k = CONFIG["num_experts_per_tok"]
    return torch.stack([x.topk(k, -1).indices.view(*batch.input_ids.shape, k) for x in out.router_logits], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        report = {"host": describe(), "model": CONFIG}
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            report[name] = measure(Path(tmp), dtype)
    print(f"# {report['host']}")
    for name in ("bfloat16", "float32"):
        r = report[name]
        print(f"{name}: {r['differing_share']:.2%} of {r['decisions']} routing decisions differ")
        for label in ("without_replay", "with_replay"):
            m = r[f"mismatch_{label}"]
            print(f"  {label:>15}: mean |d| {m['mean_abs']:.2e}, max |d| {m['max_abs']:.2e}, k3 KL {m['k3_kl']:.2e}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
