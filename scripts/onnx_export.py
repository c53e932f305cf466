#!/usr/bin/env python3
"""`python scripts/onnx_export.py --help`: the tool is `timm_sortconv.cli.onnx` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.onnx import main

if __name__ == "__main__":
    run(main)
