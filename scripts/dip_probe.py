#!/usr/bin/env python3
"""`python scripts/dip_probe.py --help`: the tool is `timm_sortconv.cli.dip_probe` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.dip_probe import main

if __name__ == "__main__":
    run(main)
