"""Public names that moved to another module keep working from their old one, with a warning naming the new home."""
from __future__ import annotations

import importlib
import warnings
from typing import Callable, Dict


def moved_names(module: str, moved: Dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` that serves each ``moved[name]`` (the new module's name)."""

    def __getattr__(name: str):
        if name in moved:
            warnings.warn(f"{module}.{name} moved to {moved[name]}.{name}; import it from there", DeprecationWarning,
                          stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
