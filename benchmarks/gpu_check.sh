#!/usr/bin/env bash
# The GPU check in one call (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh OUTDIR [--model PATH]
# Runs from the repository root with the machine's python3 (CuPy, torch, pytest there); installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: benchmarks/gpu_check.sh OUTDIR [--model PATH]}"
shift
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MINIKV_GPU_BACKEND=cupy
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$out" "$@"
