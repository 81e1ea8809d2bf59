"""`import rollout` and `rollout.Engine` work where only the engine's own
dependencies are installed (a GPU box with torch, transformers, safetensors
and tokenizers): no Ray, no xxhash, no wandb."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_engine_runs_without_ray_xxhash_or_wandb(qwen2):
    code = textwrap.dedent(
        f"""
        import sys

        class Missing:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ray", "xxhash", "wandb"):
                    raise ImportError(name + " is not installed here")
                return None

        sys.meta_path.insert(0, Missing())
        import rollout
        from rollout import Engine, SamplingParams
        engine = Engine({str(qwen2.path)!r}, device="cpu", max_seq_len=64, kv_cache_tokens=512)
        out = engine.generate([[3, 4, 5]], SamplingParams(n=2, max_tokens=4, seed=0))
        assert len(out[0].samples) == 2 and len(out[0].samples[0].token_ids) <= 4
        assert not set(("ray", "xxhash", "wandb", "transformers")).intersection(sys.modules)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
