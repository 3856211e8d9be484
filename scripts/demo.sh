#!/usr/bin/env bash
# `make demo`: start `dsec serve` if none is running, then drive it with the SDK.
set -euo pipefail
cd "$(dirname "$0")/.."
URL=${DSEC_URL:-http://127.0.0.1:7070}
HOME_DIR=${DSEC_HOME:-/var/lib/dsec}
if ! curl -fsS "$URL/healthz" >/dev/null 2>&1; then
  mkdir -p "$HOME_DIR"
  echo "demo: starting dsec serve (log: $HOME_DIR/serve.log)"
  DSEC_HOME=$HOME_DIR nohup .venv/bin/dsec serve >>"$HOME_DIR/serve.log" 2>&1 &
  for _ in $(seq 1 200); do
    curl -fsS "$URL/healthz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -fsS "$URL/healthz" >/dev/null || { echo "demo: dsec serve did not start; see $HOME_DIR/serve.log" >&2; tail -20 "$HOME_DIR/serve.log" >&2; exit 1; }
fi
DSEC_HOME=$HOME_DIR exec .venv/bin/python scripts/demo.py
