"""The package's version (pyproject.toml holds the same), importable without the rest of the package."""
__version__ = "0.1.0"
