"""The GRPO demo that `./scripts/demo` runs (`python -m examples.grpo_demo`)."""
