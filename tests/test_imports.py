"""`import rollout` and `rollout.Engine` work where Ray is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_engine_runs_without_ray(qwen2):
    code = textwrap.dedent(
        f"""
        import sys

        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray is not installed here")
                return None

        sys.meta_path.insert(0, NoRay())
        import rollout
        from rollout import Engine, SamplingParams
        engine = Engine({str(qwen2.path)!r}, device="cpu", max_seq_len=64, kv_cache_tokens=512)
        out = engine.generate([[3, 4, 5]], SamplingParams(n=2, max_tokens=4, seed=0))
        assert len(out[0].samples) == 2 and len(out[0].samples[0].token_ids) <= 4
        assert "ray" not in sys.modules and "transformers" not in sys.modules
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
