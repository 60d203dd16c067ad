#!/usr/bin/env bash
# Fetch the wheels a GPU node without internet needs to run mmlight (and benchmarks/gpu_run.py):
# what pyproject.toml requires beyond what the node has, with their dependencies, into .whl/.
#   benchmarks/gpu_wheels.sh --have-file node-packages.txt      # the node's `pip freeze`
#   benchmarks/gpu_wheels.sh --have timm lightning tensorboard   # or the names it has
# Options: benchmarks/gpu/wheels.py (--help). Run from anywhere; the wheels go to --dest (.whl).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu.wheels "$@"
