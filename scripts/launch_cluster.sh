#!/usr/bin/env bash
# Start a Ray head, or join this machine to one, for a rollout cluster that
# spans machines. GPUs and CPUs are detected and advertised.
#
#   scripts/launch_cluster.sh head   [--port 6379] [--model CHECKPOINT [--dtype float32]] [ray start options...]
#   scripts/launch_cluster.sh worker --address HEAD_IP:6379 [--model CHECKPOINT [--dtype D]] [ray start options...]
#   scripts/launch_cluster.sh stop
#
# --model sizes this node's object store for two versions of the checkpoint's
# weights at the engine's dtype (what rollout.init does for a local Ray)
# unless --object-store-memory is given; either way a sized store is
# preallocated (RAY_preallocate_plasma_memory=1, unless already set), so
# weight pushes do not fault its pages in.
#
# Then, on the trainer's machine:
#   RAY_AUTH_MODE=token python train.py     # with rollout.init(model, address="HEAD_IP:6379")
#
# Ray token authentication is on: `head` writes a token under ~/.ray; copy
# that file to every worker machine and the trainer's machine (or export
# RAY_AUTH_TOKEN) before they join. Run Ray only on a private network: it
# executes code sent to it, as its own documentation warns.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_VENV:-$ROOT/.venv}"  # the venv scripts/_env.sh set up
RAY="${RAY:-$VENV/bin/ray}"
[ -x "$RAY" ] || RAY="$(command -v ray)"
PYTHON="${PYTHON:-$VENV/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

role="${1:-}"
shift || true
model=""
dtype="float32"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model) model="$2"; shift 2 ;;
        --model=*) model="${1#--model=}"; shift ;;
        --dtype) dtype="$2"; shift 2 ;;
        --dtype=*) dtype="${1#--dtype=}"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
set -- ${args[@]+"${args[@]}"}

resources=()
if [[ " $* " != *" --num-gpus "* ]] && command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    resources+=(--num-gpus "${gpus:-0}")
fi
if [[ " $* " != *" --num-cpus "* ]]; then
    resources+=(--num-cpus "$(nproc)")
fi
if [[ " $* " != *" --object-store-memory"* ]] && [ -n "$model" ]; then
    bytes="$(cd "$ROOT" && "$PYTHON" -c 'import sys
from rollout.cluster.ray_runtime import local_store_bytes
print(local_store_bytes(sys.argv[1], sys.argv[2]) or "")' "$model" "$dtype")"
    if [ -z "$bytes" ]; then
        echo "$0: no safetensors under $model on this machine; leaving the object store to Ray" >&2
    else
        resources+=(--object-store-memory "$bytes")
    fi
fi
if [[ " ${resources[*]+"${resources[*]}"} $* " == *" --object-store-memory"* ]]; then
    export RAY_preallocate_plasma_memory="${RAY_preallocate_plasma_memory:-1}"
fi

case "$role" in
    head)
        exec "$RAY" start --head --disable-usage-stats --include-dashboard=false ${resources[@]+"${resources[@]}"} "$@"
        ;;
    worker)
        exec "$RAY" start --disable-usage-stats ${resources[@]+"${resources[@]}"} "$@"
        ;;
    stop)
        exec "$RAY" stop "$@"
        ;;
    *)
        echo "usage: $0 head|worker|stop [--model CHECKPOINT [--dtype D]] [ray start options...]" >&2
        exit 2
        ;;
esac
