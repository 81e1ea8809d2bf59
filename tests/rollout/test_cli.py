from __future__ import annotations

import json
import subprocess
import sys

from rollout import Engine, SamplingParams
from rollout.cli import main


def test_generate_writes_one_line_per_prompt(text_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"hello"\n{"prompt": "abc"}\n\n[1, 40, 41]\n{"prompt_token_ids": [1, 50]}\n')
    out = tmp_path / "out" / "samples.jsonl"
    rc = main(
        [
            "generate",
            "--model",
            str(text_checkpoint.path),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--n",
            "3",
            "--max-tokens",
            "6",
            "--seed",
            "5",
            "--max-seq-len",
            "64",
            "--kv-cache-tokens",
            "2048",
            "--ignore-eos",
            "--logprobs-mode",
            "raw",
        ]
    )
    assert rc == 0
    assert "4/4 prompts" in capsys.readouterr().err  # the progress bar
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 1, 2, 3]
    assert lines[0]["prompt"] == "hello" and lines[2]["prompt"] is None
    engine = Engine(text_checkpoint.path, device="cpu", max_seq_len=64, kv_cache_tokens=2048)
    codec = engine.tokenizer
    ref = engine.generate(
        [codec.encode("hello"), codec.encode("abc"), [1, 40, 41], [1, 50]],
        SamplingParams(n=3, max_tokens=6, seed=5, ignore_eos=True, logprobs_mode="raw"),
    )
    for record, expected in zip(lines, ref, strict=True):
        assert record["prompt_token_ids"] == expected.prompt_token_ids
        assert [s["token_ids"] for s in record["samples"]] == [s.token_ids for s in expected.samples]
        assert [s["text"] for s in record["samples"]] == [s.text for s in expected.samples]
        assert all(len(s["logprobs"]) == len(s["versions"]) == 6 for s in record["samples"])


def test_bad_prompt_file_is_a_clear_error(text_checkpoint, tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('"ok"\n{oops\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout.cli",
            "generate",
            "--model",
            str(text_checkpoint.path),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "o.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "bad.jsonl:2: not valid JSON" in done.stderr
