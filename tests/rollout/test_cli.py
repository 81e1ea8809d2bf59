from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rollout import Engine, SamplingParams
from rollout.cli import InOrder, logit_bias, main


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
            "--frequency-penalty",
            "0.5",
            "--repetition-penalty",
            "1.3",
            "--logit-bias",
            "40=2.5",
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
        SamplingParams(
            n=3,
            max_tokens=6,
            seed=5,
            ignore_eos=True,
            logprobs_mode="raw",
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias={40: 2.5},
        ),
    )
    for record, expected in zip(lines, ref, strict=True):
        assert record["prompt_token_ids"] == expected.prompt_token_ids
        assert [s["token_ids"] for s in record["samples"]] == [s.token_ids for s in expected.samples]
        assert [s["text"] for s in record["samples"]] == [s.text for s in expected.samples]
        assert all(len(s["logprobs"]) == len(s["versions"]) == 6 for s in record["samples"])


def test_logit_bias_options_parse_or_name_the_bad_one():
    assert logit_bias(["40=2.5", "7=-100"]) == {40: 2.5, 7: -100.0} and logit_bias(None) is None
    for bad in ("40", "x=1", "40=high"):
        with pytest.raises(ValueError, match="--logit-bias takes TOKEN=BIAS"):
            logit_bias([bad])


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


def _generate_args(checkpoint, prompts, out, *extra: str) -> list[str]:
    sizes = ["--max-seq-len", "64", "--kv-cache-tokens", "2048", "--max-tokens", "3", "--quiet"]
    return ["generate", "--model", str(checkpoint.path), "--prompts", str(prompts), "--out", str(out), *sizes, *extra]


def test_out_must_be_new_unless_overwrite_and_never_the_prompts(text_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 40, 41]\n")
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    assert main(_generate_args(text_checkpoint, prompts, out)) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == "earlier results\n"
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    for same in (prompts, link, tmp_path / "." / "prompts.jsonl"):
        assert main(_generate_args(text_checkpoint, prompts, same, "--overwrite")) == 2
        assert "is the --prompts file" in capsys.readouterr().err
    assert prompts.read_text() == "[1, 40, 41]\n"
    assert main(_generate_args(text_checkpoint, prompts, out, "--overwrite")) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["prompt_token_ids"] == [1, 40, 41] and len(record["samples"][0]["token_ids"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "out.jsonl", "prompts.jsonl"]


def test_records_stream_to_a_file_beside_out_and_an_interrupted_run_leaves_out_as_it_was(
    text_checkpoint, tmp_path, monkeypatch
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 40, 41]\n[1, 50]\n[1, 60, 61, 62]\n")
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    real, partial_lines = Engine.generate_iter, []

    def interrupted(self, token_lists, params):
        done = set()
        for index, result in real(self, token_lists, params):
            yield index, result  # the CLI writes what is in order before asking for the next
            done.add(index)
            (partial,) = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
            prefix = next(i for i in range(len(token_lists) + 1) if i not in done)
            lines = [json.loads(line) for line in partial.read_text().splitlines()]
            partial_lines.append((prefix, [r["index"] for r in lines]))
            if len(done) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate_iter", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(_generate_args(text_checkpoint, prompts, out, "--overwrite"))
    assert [lines for _, lines in partial_lines] == [list(range(prefix)) for prefix, _ in partial_lines]
    assert len(partial_lines) == 2
    assert out.read_text() == "earlier results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


def test_in_order_writes_each_record_once_all_before_it_are_done(tmp_path):
    path = tmp_path / "records.jsonl"
    with path.open("w") as f:
        records, seen = InOrder(f), []
        for index in [2, 0, 3, 1, 4]:
            records.add(index, {"index": index})
            seen.append([json.loads(line)["index"] for line in path.read_text().splitlines()])
    assert seen == [[], [0], [0], [0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_a_stale_partial_file_of_a_killed_run_does_not_stop_the_next(tmp_path):
    """A run killed outright leaves its partial file; the next run (in a container
    often with the same pid) writes a file of its own, with the usual permissions."""
    import os

    from rollout.cli import replacing

    out = tmp_path / "samples.jsonl"
    stale = tmp_path / f".{out.name}.{os.getpid()}.partial"
    stale.write_text("killed\n")
    with replacing(out) as f:
        f.write("new\n")
    assert out.read_text() == "new\n" and stale.read_text() == "killed\n"
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_generate_writes_routed_experts_of_a_moe_model(moe_checkpoints, tmp_path):
    from tests.rollout.server.test_routed_experts import decode

    path = moe_checkpoints["qwen3_moe"].path
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("[1, 40, 41]\n")
    flags = ["--n", "2", "--max-tokens", "5", "--seed", "3", "--ignore-eos", "--return-routed-experts"]
    sizes = ["--max-seq-len", "64", "--kv-cache-tokens", "2048", "--quiet"]
    assert main(["generate", "--model", str(path), "--prompts", str(prompts), "--out", str(out), *flags, *sizes]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    engine = Engine(path, device="cpu", max_seq_len=64, kv_cache_tokens=2048)
    params = SamplingParams(n=2, max_tokens=5, seed=3, ignore_eos=True, return_routed_experts=True)
    (ref,) = engine.generate([[1, 40, 41]], params)
    np.testing.assert_array_equal(decode(record["prompt_routed_experts"]), ref.prompt_routed_experts)
    for got, s in zip(record["samples"], ref.samples, strict=True):
        np.testing.assert_array_equal(decode(got["routed_experts"]), s.routed_experts)
