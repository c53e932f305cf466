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
# The versions the tests run with, which are also the floors pyproject.toml declares. The CUDA builds of
# this torch/torchvision pair also run on CPU-only machines; torch 2.13's CPU wheel has no matching
# torchvision on PyPI (see README, "Installation").
TORCH=2.14.1 TORCHVISION=0.29.1 TIMM=1.0.31
if ! .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==$TORCH" "torchvision==$TORCHVISION"
fi
# setuptools warns on every editable install that folders named like the package could shadow it;
# this checkout's own folder is the package, so the notice is silenced.
PYTHONWARNINGS="ignore:Editable installation:UserWarning" .venv/bin/python -m pip install -q "timm==$TIMM" -e ".[dev]"
# timm's own model tests (tests/test_timm_suite.py runs them on this package's models) ship in timm's
# source distribution, not in its wheel.
if [ ! -f .cache/timm-$TIMM/tests/test_models.py ]; then
    mkdir -p .cache
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: "timm==$TIMM" -d .cache
    tar -xzf ".cache/timm-$TIMM.tar.gz" -C .cache "timm-$TIMM/tests"
    rm ".cache/timm-$TIMM.tar.gz"
fi
