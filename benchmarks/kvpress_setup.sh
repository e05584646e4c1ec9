#!/usr/bin/env bash
# Creates a separate virtual environment for the NVIDIA kvpress peer run (benchmarks/kvpress_peer.py).
# kvpress 0.5.5 needs transformers 5.2.0, which conflicts with minikv's own .venv, hence its own venv.
# torch==2.13.0 is pinned exactly as in the Makefile: on this machine it resolves to the local
# CPU wheel (pip's find-links /opt/wheels); a plain `torch` would pull GBs of CUDA.
# Idempotent: reruns only install what is missing. Usage: bash benchmarks/kvpress_setup.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVPRESS_VENV:-$ROOT/.venv-kvpress}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check)

if [ -x "$PY" ]; then
    echo "[kvpress_setup] venv exists: $VENV"
else
    echo "[kvpress_setup] creating venv: $VENV (with $($PYTHON --version))"
    "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" --quiet --upgrade pip
fi

want() {  # want DIST VERSION: true if DIST==VERSION is already installed
    local v
    v="$("$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true)"
    [ "${v%%+*}" = "$2" ]
}

install_pinned() {  # install_pinned DIST VERSION [extra pip args...]
    local dist="$1" ver="$2"; shift 2
    if want "$dist" "$ver"; then
        echo "[kvpress_setup] already installed: $dist==$ver"
    else
        echo "[kvpress_setup] installing $dist==$ver $*"
        "${PIP[@]}" --quiet "$dist==$ver" "$@"
    fi
}

# torch first, so that nothing later can swap it for a CUDA build.
install_pinned torch 2.13.0
# Then kvpress with its exact transformers; the torch pin is repeated so pip keeps the CPU wheel.
install_pinned transformers 5.2.0 "torch==2.13.0"
install_pinned kvpress 0.5.5 "transformers==5.2.0" "torch==2.13.0"
# gguf: transformers' GGUF loader; numpy for the peer script.
for extra in gguf numpy; do
    if "$PY" -c "import importlib.metadata as m; m.version('$extra')" 2>/dev/null; then
        echo "[kvpress_setup] already installed: $extra"
    else
        echo "[kvpress_setup] installing $extra"
        "${PIP[@]}" --quiet "$extra" "transformers==5.2.0" "torch==2.13.0"
    fi
done

"$PY" -m pip check || echo "[kvpress_setup] WARNING: pip check reports conflicts (above)"
"$PY" - <<'PY'
import importlib.metadata as m
import torch
for d in ("torch", "transformers", "kvpress", "gguf", "numpy"):
    print(f"[kvpress_setup] {d}=={m.version(d)}")
print(f"[kvpress_setup] torch CUDA build: {torch.version.cuda}")
PY
echo "[kvpress_setup] done: $VENV"
