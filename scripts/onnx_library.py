#!/usr/bin/env python3
"""`python scripts/onnx_library.py`: prints the onnxruntime library's path (`timm_sortconv.cli.onnx.library_main`)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.onnx import library_main

if __name__ == "__main__":
    run(library_main)
