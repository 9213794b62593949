#!/usr/bin/env bash
# The single-process tests on the lowest torch gridtrain supports (gridtrain/compat.py OLDEST_TORCH,
# pyproject.toml), in a venv of its own beside the project's:
#     bash bench/oldest_torch.sh [VENV_DIR]        (default /tmp/gridtrain-torch-2.11)
# PyPI's torch 2.11.0 for Linux is its CUDA build (with the nvidia-* libraries it loads); it runs
# the CPU paths alike, where the CPU-only index is out of reach. The rest of the packages come from
# constraints.txt, torch's pin left out.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VENV=${1:-/tmp/gridtrain-torch-2.11}
TORCH=2.11.0
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
grep -v '^torch==' constraints.txt > "$VENV/constraints-no-torch.txt"
PIP_CONSTRAINT= "$VENV/bin/pip" install -q "torch==$TORCH"
PIP_CONSTRAINT= "$VENV/bin/pip" install -q -c "$VENV/constraints-no-torch.txt" numpy tokenizers tensorboard \
    matplotlib tqdm safetensors pytest transformers torchao
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
"$VENV/bin/python" -m pytest -q -m "not dist" -p no:cacheprovider
