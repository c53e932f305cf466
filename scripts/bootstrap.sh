#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with a working
# torch/torchvision pair, timm, and this package (editable) with its development extras.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# The CUDA builds of this pair also run on CPU-only machines; torch 2.13's CPU wheel has no
# matching torchvision on PyPI (see README, "Installation").
if ! .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
