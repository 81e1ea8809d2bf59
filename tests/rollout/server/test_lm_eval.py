"""lm-evaluation-harness against the server, through its own client code:
`local-completions` runs a local multiple-choice task and a log-likelihood task
(`lm_eval_tasks/`, no hub) with echo and logprobs, and every request's
loglikelihood equals `hf` (lm-eval on transformers, same checkpoint) to 1e-3,
with a local tokenizer and with the server's tokenizer routes. One subprocess
runs the three (lm-eval's import takes seconds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.server.conftest import API_KEY

HERE = Path(__file__).parent
pytest.importorskip("lm_eval", reason="lm-eval is in the dev set-up (scripts/_env.sh): pip install lm-eval")


def test_lm_eval_loglikelihoods_through_the_server_equal_hf(tiny_server, tiny_path, tmp_path):
    with tiny_server.http() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    out = tmp_path / "lm_eval.json"
    # transformers would load the checkpoint's tokenizer as its family's (Qwen2's pre-tokenizer): this
    # directory makes it read tokenizer.json as it is, as the server does.
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(tiny_path / "tokenizer.json", tokenizer)
    config = json.loads((tiny_path / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    cmd = [
        sys.executable,
        str(HERE / "lm_eval_run.py"),
        str(tiny_path),
        str(tokenizer),
        tiny_server.url,
        model,
        str(out),
    ]
    done = subprocess.run(cmd, cwd=HERE / "lm_eval_tasks", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = json.loads(out.read_text())
    hf = runs["hf"]
    assert {task: len(docs) for task, docs in hf.items()} == {"rollout_mc": 3, "rollout_ll": 3}
    assert [len(v) for v in hf["rollout_mc"].values()] == [3, 4, 3]  # one request per choice
    for name in ("local", "remote"):
        for task, docs in hf.items():
            assert runs[name][task].keys() == docs.keys()
            for doc, expected in docs.items():
                assert runs[name][task][doc] == pytest.approx(expected, abs=1e-3), (name, task, doc)
