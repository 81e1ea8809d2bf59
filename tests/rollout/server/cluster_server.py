"""`rollout serve --actors N ...` with a trainer beside it in the same
process, as an RL job runs it: each `push` line on stdin pushes perturbed
weights to the server's cluster (the default cluster `rollout.init` made)
and answers `pushed VERSION` on stdout. `hold` kills every actor and holds
their replacements back (answering `held`), `release` lets them start and
answers `released` once all are alive.

    python -m tests.rollout.server.cluster_server --model DIR --actors 2 [rollout serve flags]
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

import rollout
from rollout.cli import main
from rollout.cluster import api


def trainer(model: Path) -> None:
    state = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for line in sys.stdin:
        if line.strip() == "push":
            state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
            print(f"pushed {rollout.push_weights(state)}", flush=True)
        elif line.strip() == "hold":
            pool = api._cluster()._pool
            pool._gate.lock.acquire()  # replacements spawn holding the push gate: none starts meanwhile
            for slot in pool.slots:
                pool.kill(slot, "killed by the test")
            print("held", flush=True)
        elif line.strip() == "release":
            api._cluster()._pool._gate.lock.release()
            api._cluster().wait_until_healthy(120)
            print("released", flush=True)


if __name__ == "__main__":
    model = Path(sys.argv[sys.argv.index("--model") + 1])
    threading.Thread(target=trainer, args=(model,), daemon=True).start()
    sys.exit(main(["serve", *sys.argv[1:]]))
