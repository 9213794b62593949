#!/usr/bin/env bash
# Fill the git-ignored folder .whl/ with the wheels bench/gpu/titan_side.py needs
# on the GPU machine (Python 3.12, torch 2.11.0+cu130 preinstalled, no registry).
# Run from the repo root on a machine that reaches PyPI:
#     bash bench/gpu/fetch_wheels.sh
# On the GPU machine:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#         --upgrade --target /tmp/site .whl/*.whl
#     PYTHONPATH=/tmp/site python bench/gpu/titan_side.py ...
#
# Minimal set, found by importing torchtitan.models.llama3 (+ parallelize_llama),
# torchtitan.distributed.{activation_checkpoint,compile,cudagraph},
# torchtitan.components.{loss,optimizer}:
#   torchtitan 0.3.0   (pure python)
#   spmd_types 0.2.3   (pinned by torchtitan, imported by components/loss, models)
#   tyro + docstring-parser + typeguard (torchtitan.config imports tyro; tyro
#                       imports docstring_parser, typeguard; shtab not needed)
#   typing_extensions 4.16.0 (tyro needs >=4.13, typeguard >=4.14; the GPU
#                       box's copy may be older; backward compatible)
#   torchao 0.17.0     (not imported by the model path; for FP8 later. abi3
#                       wheel, requires torch>=2.11, released with torch 2.11)
# NOT needed (only reached via torchtitan.trainer / dataloaders / metrics, which
# titan_side.py does not import): torchdata, torch_checkpointing, datasets, wandb.
# All are py3-none-any or cp310-abi3, so one set serves cp311 (CPU test) and cp312.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
GIT_DIR=$(git rev-parse --git-dir)
mkdir -p "$GIT_DIR/info"
grep -qxF '/.whl/' "$GIT_DIR/info/exclude" 2>/dev/null || echo '/.whl/' >> "$GIT_DIR/info/exclude"
mkdir -p .whl

PKGS=(
  torchtitan==0.3.0
  spmd_types==0.2.3
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.1
  torchao==0.17.0
  typing_extensions==4.16.0
)

for pkg in "${PKGS[@]}"; do
  PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d .whl "$pkg"
done

ls -la .whl
du -ch .whl/*.whl | tail -1
