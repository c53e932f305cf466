#!/usr/bin/env python3
"""`python scripts/ablation.py --help`: the tool is `timm_sortconv.cli.ablation` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.ablation import main

if __name__ == "__main__":
    run(main)
