#!/usr/bin/env bash
# A separate virtualenv for the `transformers serve --continuous-batching` peer: its
# [serving] extra pulls FastAPI/uvicorn/openai pins that Sluice's own venv must not get.
# Cached and idempotent.  Usage: bench/setup_transformers_serve.sh [VENV]
set -euo pipefail
VENV="${1:-build/peers/tf-serve-venv}"
PYTHON="${PYTHON:-python3}"
if [ -x "$VENV/bin/transformers" ] && [ -f "$VENV/.installed" ]; then
  echo "transformers serve: cached in $VENV"; exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch pinned to the same CPU build as Sluice's (pip takes it from the local wheel).
"$VENV/bin/pip" install -q "torch==2.13.0" "transformers[serving]==5.24.0"
touch "$VENV/.installed"
echo "transformers serve: installed in $VENV"
