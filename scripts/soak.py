"""Soak a local rollout cluster: concurrent callers with random prompts and
sampling settings while weights are pushed every half second, cycling
through every in-flight mode; prints a report and fails on any problem.

    python -m scripts.soak [--seconds 120] [--callers 4] [--out runs/soak.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import rollout
from scripts.bench import write_json
from scripts.soak_harness import SOAK_CLUSTER, SoakReport, soak
from scripts.synthetic import qwen2_config, random_state, write_checkpoint


def run(seconds: float, callers: int, push_every: float) -> SoakReport:
    """The soak on a fresh local cluster of the `soak` preset, pushing three random states in turn."""
    cfg = qwen2_config("soak")
    path = Path(tempfile.mkdtemp(prefix="soak_"))
    write_checkpoint(path, cfg, seed=0)
    states = [random_state(cfg, seed) for seed in (1, 2, 3)]
    cluster = rollout.init(path, device="cpu", **SOAK_CLUSTER)
    try:
        return soak(cluster, states, seconds, callers=callers, push_every=push_every)
    finally:
        rollout.shutdown()


def print_report(report: SoakReport) -> None:
    print(
        f"{report.seconds:.0f} s: {report.calls} calls, {report.samples} samples, {report.tokens} tokens, "
        f"{report.pushes} pushes {report.pushes_by_mode}"
    )
    print(
        f"resident memory growth (first to last quarter): driver {100 * report.driver_rss_growth:+.1f}%, "
        f"worst actor {100 * report.actor_rss_growth:+.1f}%"
    )
    print(f"watchdog (replacements, hangs, stalls per actor): {report.watchdog_faults}")
    print(f"last push serves exactly: {report.final_exact}; problems: {len(report.errors)}")
    for problem in report.errors[:10]:
        print("  " + problem)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--push-every", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=Path("runs/soak.json"))
    args = parser.parse_args()
    report = run(args.seconds, args.callers, args.push_every)
    write_json(args.out, {**asdict(report), "errors": report.errors[:50], "ok": report.ok})
    print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
