#!/usr/bin/env bash
# The GPU suite rehearsed on CPU, as the GPU machine will run it: fetch the carried wheels
# (fetch_wheels.sh, into .whl/), install them into a scratch target with pip's offline flags,
# run every part of suite.py on tiny shapes and print the table summarize.py makes of it.
#     bash bench/gpu/rehearse.sh [OUT_DIR] [PYTHON]     (defaults: /tmp/gpu-rehearsal, python3)
# PYTHON is the interpreter whose torch the suite uses (e.g. a venv of torch 2.11.0,
# bench/oldest_torch.sh's, to rehearse the GPU machine's torch).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=${1:-/tmp/gpu-rehearsal}
PY=${2:-python3}
SITE=$(mktemp -d /tmp/gpu-site.XXXXXX)
bash bench/gpu/fetch_wheels.sh
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
rm -rf "$OUT"
PYTHONPATH="$SITE" "$PY" bench/gpu/suite.py --out "$OUT" --cpu-rehearsal
"$PY" bench/gpu/summarize.py "$OUT"
rm -rf "$SITE"
