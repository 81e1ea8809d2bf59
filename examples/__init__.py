"""Runnable examples; run from the repository root (`python -m examples.grpo_demo`)."""
