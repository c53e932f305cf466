#!/usr/bin/env bash
# Runs the whole test suite on the oldest versions pyproject.toml declares: torch, torchvision, timm,
# huggingface_hub and safetensors exactly at their floors ("NAME>=X" read from pyproject.toml), on the Python
# given (the oldest requires-python allows), in a virtual environment of its own that scripts/bootstrap.sh
# sets up like .venv. .venv is left alone; CI keeps testing the newest versions there.
#
#   PYTHON=python3.10 bash scripts/check_floor.sh            # the environment: .cache/floor
#   PYTHON=python3.10 FLOOR_VENV=/tmp/floor bash scripts/check_floor.sh -x tests/test_operator.py
#
# Arguments go to pytest. The first run downloads torch's CUDA build and its libraries (a few GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.10}
FLOOR_VENV=${FLOOR_VENV:-.cache/floor}
if ! "$PYTHON" -c "" 2>/dev/null; then
    echo "check_floor: cannot run PYTHON=$PYTHON; set PYTHON to a Python interpreter, e.g. PYTHON=/usr/bin/python3.10" >&2
    exit 2
fi
floor() {
    local version
    version=$(sed -n "s/^ *\"$1>=\([0-9][0-9.]*\)\".*/\1/p" pyproject.toml)
    if [ -z "$version" ]; then
        echo "check_floor: pyproject.toml declares no \"$1>=VERSION\" dependency" >&2
        exit 2
    fi
    echo "$version"
}
TORCH=$(floor torch) TORCHVISION=$(floor torchvision) TIMM=$(floor timm)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf '%s\n' "torch==$TORCH" "torchvision==$TORCHVISION" "timm==$TIMM" \
    "huggingface_hub==$(floor huggingface_hub)" "safetensors==$(floor safetensors)" > "$constraints"
echo "check_floor: $("$PYTHON" --version) with $(tr '\n' ' ' < "$constraints")in $FLOOR_VENV"
PIP_CONSTRAINT=$constraints PYTHON=$PYTHON VENV=$FLOOR_VENV TORCH=$TORCH TORCHVISION=$TORCHVISION TIMM=$TIMM \
    bash scripts/bootstrap.sh
"$FLOOR_VENV/bin/python" -m pip list 2>/dev/null | grep -i -E "^(torch|torchvision|timm|huggingface.hub|safetensors) "
"$FLOOR_VENV/bin/python" -m pytest -q "$@"
