#!/usr/bin/env python3
"""`python scripts/demo.py --help`: the tool is `timm_sortconv.cli.demo` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.demo import main

if __name__ == "__main__":
    run(main)
