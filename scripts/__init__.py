"""Benchmarks, checks and harnesses. Run them from the repository root as
modules (`python -m scripts.bench`), so they import each other and the
project as packages."""
