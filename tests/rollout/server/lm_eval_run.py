"""Run lm-evaluation-harness' local task files (`lm_eval_tasks/`) against a
model three ways in one process (lm-eval's import is slow): `hf` on a
checkpoint, and `local-completions` against a server, with a local copy of
the tokenizer and with the server's tokenizer routes. Writes each run's
per-sample loglikelihoods as JSON: {run: {task: {doc_id: [ll per request]}}}.

    python lm_eval_run.py CHECKPOINT TOKENIZER SERVER_URL MODEL_NAME OUT.json   (cwd: lm_eval_tasks/)

TOKENIZER: a directory transformers loads the checkpoint's tokenizer.json from as it is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

TASKS = ["rollout_mc", "rollout_ll"]


def loglikelihoods(results: dict) -> dict:
    return {
        task: {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in samples}
        for task, samples in results["samples"].items()
    }


def main(checkpoint: str, tokenizer: str, url: str, model: str, out: str) -> None:
    tasks = TaskManager(include_path=str(Path.cwd()), include_defaults=False)
    completions = f"base_url={url}/v1/completions,model={model},tokenized_requests=True,max_retries=1"
    runs = {
        # No BOS, as lm-eval's API models (and its remote tokenizer) encode: the same token ids everywhere.
        "hf": ("hf", f"pretrained={checkpoint},tokenizer={tokenizer},dtype=float32,add_bos_token=False"),
        "local": ("local-completions", f"{completions},tokenizer_backend=huggingface,tokenizer={tokenizer}"),
        # Its tokenizer routes are asked with the key as any route is (lm-eval's completions send OPENAI_API_KEY).
        "remote": (
            "local-completions",
            f"{completions},tokenizer_backend=remote,auth_token={os.environ['OPENAI_API_KEY']}",
        ),
    }
    found = {}
    for name, (kind, args) in runs.items():
        results = simple_evaluate(kind, args, TASKS, device="cpu", task_manager=tasks, bootstrap_iters=0)
        found[name] = loglikelihoods(results)
    Path(out).write_text(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
