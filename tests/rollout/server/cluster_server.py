"""`rollout serve --actors N ...` with a trainer beside it in the same
process, as an RL job runs it: each `push` line on stdin pushes perturbed
weights to the server's cluster (the default cluster `rollout.init` made)
and answers `pushed VERSION` on stdout.

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


def trainer(model: Path) -> None:
    state = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for line in sys.stdin:
        if line.strip() == "push":
            state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
            print(f"pushed {rollout.push_weights(state)}", flush=True)


if __name__ == "__main__":
    model = Path(sys.argv[sys.argv.index("--model") + 1])
    threading.Thread(target=trainer, args=(model,), daemon=True).start()
    sys.exit(main(["serve", *sys.argv[1:]]))
