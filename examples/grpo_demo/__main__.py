"""GRPO on an embedded local Ray cluster: a tiny model learns a rule from a
programmatic reward, with a weight push after every optimizer step.

    python -m examples.grpo_demo [--steps 80] [--actors 2] [--out runs/demo] [--no-wandb] [--task rule|tool|distill]
        [--colocate] [--lora] [--distill-top-k K]
        [--model dense|moe]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from examples.grpo_demo.trainer import DemoConfig, run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.grpo_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps, one weight push each (80; tool: 150)")
    parser.add_argument("--actors", type=int, default=2, help="rollout actors")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--no-wandb", action="store_true", help="no wandb run (offline by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--task",
        choices=("rule", "tool", "distill"),
        default="rule",
        help="rule: one turn; tool: multi-turn, ask the environment for a secret digit, then answer; "
        "distill: the rule task learnt from a teacher's logprobs (on-policy distillation, reverse KL)",
    )
    parser.add_argument(
        "--oversample", type=float, default=0.0, help="submit this fraction more groups; train on the first to finish"
    )
    parser.add_argument("--tis", action="store_true", help="truncated importance sampling (docs/off_policy.md)")
    parser.add_argument(
        "--colocate", action="store_true", help="one process: an in-process engine asleep during each optimizer step"
    )
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT); pushes send adapters only")
    parser.add_argument(
        "--model", choices=("dense", "moe"), default="dense", help="moe: a Qwen3-MoE policy trained with routing replay"
    )
    parser.add_argument(
        "--distill-top-k",
        type=int,
        default=0,
        help="distill: the reverse KL over the teacher's top k (1-20) instead of the sampled token's (0)",
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 150 if args.task == "tool" else 80
    summary = run(
        DemoConfig(
            steps=args.steps,
            actors=args.actors,
            out=args.out,
            wandb=not args.no_wandb,
            seed=args.seed,
            task=args.task,
            oversample=args.oversample,
            tis=args.tis,
            colocate=args.colocate,
            lora=args.lora,
            model=args.model,
            distill_top_k=args.distill_top_k,
        )
    )
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'reward.png'}")


if __name__ == "__main__":
    main()
