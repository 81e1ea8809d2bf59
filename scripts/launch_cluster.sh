#!/usr/bin/env bash
# Start a Ray head, or join this machine to one, for a rollout cluster that
# spans machines. GPUs and CPUs are detected and advertised.
#
#   scripts/launch_cluster.sh head   [--port 6379] [ray start options...]
#   scripts/launch_cluster.sh worker --address HEAD_IP:6379 [ray start options...]
#   scripts/launch_cluster.sh stop
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
RAY="${RAY:-${ROLLOUT_VENV:-$ROOT/.venv}/bin/ray}"  # the venv scripts/_env.sh set up
[ -x "$RAY" ] || RAY="$(command -v ray)"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

role="${1:-}"
shift || true
resources=()
if [[ " $* " != *" --num-gpus "* ]] && command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    resources+=(--num-gpus "${gpus:-0}")
fi
if [[ " $* " != *" --num-cpus "* ]]; then
    resources+=(--num-cpus "$(nproc)")
fi

case "$role" in
    head)
        exec "$RAY" start --head --disable-usage-stats --include-dashboard=false "${resources[@]}" "$@"
        ;;
    worker)
        exec "$RAY" start --disable-usage-stats "${resources[@]}" "$@"
        ;;
    stop)
        exec "$RAY" stop "$@"
        ;;
    *)
        echo "usage: $0 head|worker|stop [ray start options...]" >&2
        exit 2
        ;;
esac
