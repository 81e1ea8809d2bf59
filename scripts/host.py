"""What a benchmark ran on: the CPU model (as /proc/cpuinfo names it, with
its family and model numbers, since some hosts name only the vendor) and
the torch build."""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_model() -> str:
    """e.g. "AMD EPYC (family 25, model 1), 2 cores"; "unknown CPU" where /proc/cpuinfo is absent."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    cores = text.count("processor\t:")
    name = fields.get("model name", "unknown CPU")
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}), {cores} cores"


def describe() -> str:
    """One line for a benchmark's header."""
    return f"{cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
