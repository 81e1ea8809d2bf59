#!/usr/bin/env python
"""Soak a local rollout cluster: concurrent callers with random prompts and
sampling settings while weights are pushed every half second, cycling
through every in-flight mode; prints a report and fails on any problem.

    .venv/bin/python -m scripts.soak [--seconds 120] [--callers 4] [--out runs/soak.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import rollout
from scripts.soak_harness import SOAK_CLUSTER, soak
from scripts.synthetic import qwen2_config, random_state, write_checkpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--push-every", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=Path("runs/soak.json"))
    args = parser.parse_args()
    cfg = qwen2_config(vocab=512, hidden=128, intermediate=352, layers=2, heads=4, kv_heads=2, max_positions=256)
    path = Path(tempfile.mkdtemp(prefix="soak_"))
    write_checkpoint(path, cfg, seed=0)
    states = [random_state(cfg, seed) for seed in (1, 2, 3)]
    cluster = rollout.init(path, device="cpu", **SOAK_CLUSTER)
    try:
        report = soak(cluster, states, args.seconds, callers=args.callers, push_every=args.push_every)
    finally:
        rollout.shutdown()
    result = {**asdict(report), "errors": report.errors[:50], "ok": report.ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"{report.seconds:.0f} s: {report.calls} calls, {report.samples} samples, {report.tokens} tokens, "
        f"{report.pushes} pushes {report.pushes_by_mode}"
    )
    print(
        f"resident memory growth (first to last quarter): driver {100 * report.driver_rss_growth:+.1f}%, "
        f"worst actor {100 * report.actor_rss_growth:+.1f}%"
    )
    print(f"last push serves exactly: {report.final_exact}; problems: {len(report.errors)}")
    for problem in report.errors[:10]:
        print("  " + problem)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
