#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with a working
# torch/torchvision pair, timm, and this package (editable) with its development extras; the Hub mirror
# server the HTTP download test runs (.cache/olah); and the fused CPU kernel, built once here so that no
# later run compiles it. Each step prints a line, and pip shows what it downloads and installs.
# Safe to run again: it only installs what is missing.
# PYTHON, VENV, TORCH, TORCHVISION and TIMM override the defaults below (scripts/check_floor.sh sets them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
step() { echo "bootstrap [$1/6, ${SECONDS}s]: $2"; }

step 1 "virtual environment $VENV"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# The newest torch/torchvision/timm, which CI tests; pyproject.toml's floors, the oldest versions, are what
# scripts/check_floor.sh tests. The CUDA builds of this torch/torchvision pair also
# run on CPU-only machines; torch 2.13's CPU wheel has no matching torchvision on PyPI (see README,
# "Installation").
TORCH=${TORCH:-2.14.1} TORCHVISION=${TORCHVISION:-0.29.1} TIMM=${TIMM:-1.0.31}
OLAH=0.5.4
if ! "$VENV/bin/python" -c "import torch, torchvision" >/dev/null 2>&1; then
    step 2 "torch $TORCH and torchvision $TORCHVISION (a few GB on a first install)"
    "$VENV/bin/python" -m pip install --upgrade pip
    "$VENV/bin/python" -m pip install "torch==$TORCH" "torchvision==$TORCHVISION"
else
    step 2 "torch and torchvision: installed ($("$VENV/bin/python" -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__)'))"
fi
step 3 "timm $TIMM and this package (editable) with its development extras"
# setuptools warns on every editable install that folders named like the package could shadow it;
# this checkout's own folder is the package, so the notice is silenced.
PYTHONWARNINGS="ignore:Editable installation:UserWarning" "$VENV/bin/python" -m pip install "timm==$TIMM" -e ".[dev]"
# timm's own model tests (tests/test_timm_suite.py runs them on this package's models) ship in timm's
# source distribution, not in its wheel. timm's train.py, validate.py and benchmark.py are in neither (only in its
# GitHub repository, which a set-up that reaches package registries only cannot fetch): the tests that run them
# need TIMM_SCRIPTS_DIR (tests/conftest.py).
step 4 "timm's model tests (.cache/timm-$TIMM/tests)"
if [ ! -f .cache/timm-$TIMM/tests/test_models.py ]; then
    mkdir -p .cache
    "$VENV/bin/python" -m pip download --no-deps --no-binary :all: "timm==$TIMM" -d .cache
    tar -xzf ".cache/timm-$TIMM.tar.gz" -C .cache "timm-$TIMM/tests"
    rm ".cache/timm-$TIMM.tar.gz"
fi
# tests/test_hub_http.py downloads weights over HTTP from olah, a self-hosted Hub mirror. It has an
# environment of its own: its web-server dependencies (fastapi, pydantic, uvicorn, requests, its own
# huggingface_hub range) then never change the versions the package is tested with in .venv. Nor do the
# package's pins apply to it (scripts/check_floor.sh pins the floors through PIP_CONSTRAINT).
step 5 "Hub mirror server olah $OLAH for the HTTP download test (.cache/olah)"
if ! .cache/olah/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('olah') != '$OLAH')" \
        >/dev/null 2>&1; then
    "$PYTHON" -m venv .cache/olah
    env -u PIP_CONSTRAINT .cache/olah/bin/python -m pip install "olah==$OLAH"
fi
step 6 "the fused CPU kernel (about a minute on 2 idle cores where it is not built yet)"
"$VENV/bin/python" -c "
from timm_sortconv.ops import backends, cpu_backend
if backends.fast_disabled():
    print(f'bootstrap: the fused CPU kernel is switched off ({backends.DISABLE_ENV})')
elif cpu_backend.load_extension() is None:
    print('bootstrap: no fused CPU kernel (the warning above says why); SortConv2d uses the reference path')
else:
    print(f'bootstrap: the fused CPU kernel ({cpu_backend.cpu_isa()}) is ready')
"
echo "bootstrap: done in ${SECONDS}s"
