#!/usr/bin/env python3
"""`python scripts/push_to_hub.py --help`: the tool is `timm_sortconv.cli.push_to_hub` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.push_to_hub import main

if __name__ == "__main__":
    run(main)
