#!/usr/bin/env bash
# The GPU check in one call (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh OUTDIR [--model PATH]
# Runs from the repository root with the machine's python3 (CuPy, torch, pytest there); installs nothing.
# `timeout 560` bounds the whole run (the device tool allows 600 s per command): the script writes its
# JSON after every stage, so a hang still leaves OUTDIR/gpu_check.json with what was measured.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: benchmarks/gpu_check.sh OUTDIR [--model PATH] [--sim-smoke]}"
shift
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case " $* " in *" --sim-smoke "*) ;; *) export MINIKV_GPU_BACKEND=cupy ;; esac
limit=()
if command -v timeout >/dev/null; then limit=(timeout --kill-after=10 560); else
    echo "gpu_check: no timeout command here; relying on the script's own --budget"; fi
"${limit[@]}" "${PYTHON:-python3}" benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu_check: stopped by timeout 560 (status $status); $out/gpu_check.json holds the stages that finished"
fi
exit "$status"
