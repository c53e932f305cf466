#!/usr/bin/env python3
"""`python scripts/model_cards.py --help`: the tool is `timm_sortconv.cli.model_cards` (its docstring says what it does)."""
from timm_sortconv.cli import run
from timm_sortconv.cli.model_cards import main

if __name__ == "__main__":
    run(main)
