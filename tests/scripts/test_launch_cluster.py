"""A real multi-process Ray cluster on loopback: `scripts/launch_cluster.sh
head` in its own process group, a driver in another process joining it by
address, generating and pushing weights; then the head is stopped by
signalling its group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
    """
    import json, sys, time, copy
    import torch
    import rollout
    from rollout import SamplingParams
    from transformers import AutoModelForCausalLM
    from tests.factories import _randomize, hf_logprobs

    deadline = time.monotonic() + 90
    while True:
        try:
            cluster = rollout.init({model!r}, num_actors=2, num_cpus_per_actor=1, address={address!r},
                                   max_seq_len=128, kv_cache_tokens=2048, timeout_s=120)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    hf = AutoModelForCausalLM.from_pretrained({model!r}).eval()
    params = SamplingParams(n=2, max_tokens=12, seed=3, ignore_eos=True, logprobs_mode="raw")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [4] * 9, [20, 21]]
    def error(model, outs):
        return max((hf_logprobs(model, o.prompt_token_ids, s.token_ids)
                    - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item()
                   for o in outs for s in o.samples)
    before = error(hf, rollout.generate(prompts, params))
    pushed = copy.deepcopy(hf)
    _randomize(pushed, 5)
    version = rollout.push_weights(pushed.state_dict())
    outs = rollout.generate(prompts, params)
    print(json.dumps({{
        "error_before": before, "error_after": error(pushed, outs), "version": version,
        "token_versions": sorted({{v for o in outs for s in o.samples for v in s.versions}}),
        "actor_versions": [h["version"] for h in rollout.health()],
        "ray_address": __import__("ray").get_runtime_context().gcs_address,
    }}))
    rollout.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loopback_multiprocess_cluster(qwen2, tmp_path):
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(ROOT / "scripts" / "launch_cluster.sh"),
            "head",
            "--port",
            str(port),
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            "2",
            "--block",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        address = f"127.0.0.1:{port}"
        code = DRIVER.format(root=str(ROOT), model=str(qwen2.path), address=address)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(30)
    assert result["ray_address"] == address  # joined the launched head, not a new local instance
    assert result["error_before"] < 1e-4 and result["error_after"] < 1e-4
    assert result["version"] == 1 and result["token_versions"] == [1] and result["actor_versions"] == [1, 1]
