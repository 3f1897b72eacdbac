#!/usr/bin/env bash
# Run the app with `flwr run .` on Flower's local simulation SuperLink, then stop that SuperLink.
#
#   deploy/flwr-run-local.sh [CLIENTS] [--run-config "key=value ..."]
#
# Flower 1.39's `local` connection starts a detached `flower-superlink --simulation` that outlives
# the run; this script stops (by process id) every such SuperLink it did not find running before,
# also on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
clients="${1:-4}"
shift || true
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr}"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
before=$(pgrep -f "flower-superlink.*--simulation" || true)
stop_new_superlinks() {
  local started=()
  for pid in $(pgrep -f "flower-superlink.*--simulation" || true); do
    grep -qx "$pid" <<<"$before" || started+=("$pid")
  done
  [ ${#started[@]} -gt 0 ] || return 0
  kill "${started[@]}" 2>/dev/null || true
  for _ in $(seq 100); do  # up to 10 s to exit cleanly, then SIGKILL
    kill -0 "${started[@]}" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "${started[@]}" 2>/dev/null || true
}
trap stop_new_superlinks EXIT
flwr run . local --federation-config "num-supernodes=$clients" --run-config "clients=$clients" "$@" --stream
