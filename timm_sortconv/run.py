"""Run any of timm's scripts with this package's models registered: ``python -m timm_sortconv.run SCRIPT ARGS``.

timm's ``train.py``, ``validate.py``, ``benchmark.py`` and ``inference.py`` (in timm's repository, not in
its wheel) find models through ``timm.create_model``, which knows the SC models once ``timm_sortconv``
is imported. Only ``train.py`` can import a plugin itself (``--device-modules``); this launcher imports
the package and then runs the script as ``__main__`` with ``ARGS`` as its command line, so the same
models work in all of them::

    python -m timm_sortconv.run path/to/pytorch-image-models/validate.py --model scnn_p_rs_7 --pretrained \\
        --data-dir DATA --dataset torch/mnist --split test --num-classes 10 --input-size 1 28 28 ...

The script's exit status is the launcher's.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

USAGE = ("usage: python -m timm_sortconv.run SCRIPT [ARGS ...]\n"
         "  SCRIPT: one of timm's scripts (train.py, validate.py, benchmark.py, inference.py) or any Python file;\n"
         "  ARGS: its command line, passed through unchanged")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Imports ``timm_sortconv`` and runs ``argv[0]`` as ``__main__`` with ``argv[1:]`` as its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"error: {script} is not a file\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    from . import models, onnx  # noqa: F401  (register the models with timm and the ONNX translations)

    sys.argv = [script, *argv[1:]]
    # The script's folder first on the path, as when it runs as `python SCRIPT`.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
