#!/usr/bin/env python3
"""`python scripts/mnist_results.py --help`: the tool is `timm_sortconv.cli.mnist_results` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.mnist_results import main

if __name__ == "__main__":
    run(main)
