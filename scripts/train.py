#!/usr/bin/env python3
"""`python scripts/train.py --help`: the tool is `timm_sortconv.cli.train` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.train import main

if __name__ == "__main__":
    run(main)
