"""Data sets of the paper and their protocols, behind one ``create_dataset`` that also serves timm's.

Names (``--dataset`` in ``scripts/train.py`` and ``scripts/validate.py``) and their splits:

- ``sortconv/mnist``: MNIST from its IDX files (:class:`MNIST`); ``train`` (50k), ``validation``
  (the other 10k of the training set), ``trainval`` (60k), ``test`` (10k). The package ships a sample
  of 6,000 + 500 images in the same layout (:func:`mnist_sample_dir`).
- ``sortconv/mnist_rot``: MNIST-rot, a split (``test`` by default, 360k items) rotated by 0, 10, ...,
  350 degrees (:class:`RotatedDataset`; ``angles=`` for other angles).
- ``sortconv/outex12``: Outex_TC_00012 under the paper's protocol (:class:`OutexTC12`); ``train``
  (1440), ``train:inca+t184`` (960), ``train:inca`` (480), ``test`` (7680).
- ``sortconv/nwpu45``: NWPU-RESISC45, seeded per-class split, 128x128 (:class:`NWPU45`); ``train``
  (400 per class), ``train:300``, ``train:200``, ``test`` (300 per class).
- anything else: passed to :func:`timm.data.create_dataset` (an image folder, ``torch/...``,
  ``hfds/...``, ...) with timm's splits.

All of them return ``(image, label)`` with ``PIL`` images, so timm's transforms, ``create_loader``
and its prefetcher work unchanged, grayscale (``"L"``, one channel) included.
``python -m timm_sortconv.data.export`` writes a protocol's splits as image folders for timm's own
``train.py`` (:mod:`.export`).
"""
from __future__ import annotations

import os
from typing import Optional

from .common import DatasetLayoutError, SubsetDataset, cap_samples
from .config import resolve_data_config
from .loader import ResumableSampler, create_train_loader
from .mnist import MNIST, mnist_sample_dir, read_idx
from .nwpu import NWPU45
from .outex import OUTEX_ANGLES, OUTEX_ILLUMINANTS, OutexTC12
from .rotation import MNIST_ROT_ANGLES, RotatedDataset, parse_rotations, rotate_image
from .synthetic import synthetic_digits

__all__ = [
    "DATASETS",
    "DatasetLayoutError",
    "MNIST",
    "MNIST_ROT_ANGLES",
    "NWPU45",
    "OUTEX_ANGLES",
    "OUTEX_ILLUMINANTS",
    "OutexTC12",
    "ResumableSampler",
    "RotatedDataset",
    "SubsetDataset",
    "cap_samples",
    "create_dataset",
    "create_train_loader",
    "is_sortconv_dataset",
    "mnist_sample_dir",
    "parse_rotations",
    "read_idx",
    "resolve_data_config",
    "rotate_image",
    "synthetic_digits",
]

PREFIX = "sortconv/"
DATASETS = ("mnist", "mnist_rot", "outex12", "nwpu45")
_FOLDER_LAYOUT = """\
  ROOT/<split>/<class name>/<image>   (e.g. ROOT/train/cat/001.jpg; the split folder is optional)
  or a timm dataset name such as torch/cifar10 or hfds/<repo> (see timm.data.create_dataset)"""


def is_sortconv_dataset(name: str) -> bool:
    """Whether ``name`` is one of this package's data sets (``sortconv/...``)."""
    return name.lower().startswith(PREFIX)


def create_dataset(name: str, root: Optional[str] = None, split: str = "validation", *, download: bool = False,
                   **kwargs):
    """Builds a data set by name: this package's ``sortconv/...`` ones, or any of timm's.

    Args:
        name: ``sortconv/mnist``, ``sortconv/mnist_rot``, ``sortconv/outex12``, ``sortconv/nwpu45``, or a
            name :func:`timm.data.create_dataset` accepts (empty for an image folder).
        root: the data folder.
        split: the split (see the table in the module docstring; timm's names for timm's data sets).
        download: allow downloading (MNIST and timm's ``torch/`` data sets) when the files are missing.
        **kwargs: passed to the data set (e.g. ``angles=`` for ``mnist_rot``, ``split_seed=``,
            ``train_pool=``), or to timm for timm's names.
    """
    if not is_sortconv_dataset(name):
        return _create_timm_dataset(name, root, split, download, **kwargs)
    if root is None:
        raise DatasetLayoutError(None, f"{name} needs a data folder (--data-dir)", "see timm_sortconv.data")
    short = name[len(PREFIX):].lower()
    if short == "mnist":
        return MNIST(root, split, download=download, **kwargs)
    if short == "mnist_rot":
        angles = kwargs.pop("angles", MNIST_ROT_ANGLES)
        return RotatedDataset(MNIST(root, split, download=download, **kwargs), angles)
    if short == "outex12":
        return OutexTC12(root, split, **kwargs)
    if short == "nwpu45":
        return NWPU45(root, split, **kwargs)
    raise ValueError(f"unknown data set {name!r}; accepted: {', '.join(PREFIX + d for d in DATASETS)}, "
                     "or any name timm.data.create_dataset accepts")


def _create_timm_dataset(name: str, root, split: str, download: bool, **kwargs):
    from timm.data import create_dataset as timm_create_dataset

    prefix = name.partition("/")[0].lower() if "/" in name else ""
    reads_a_folder = prefix in ("", "folder") or name.lower() in ("torch/image_folder", "torch/folder")
    if reads_a_folder and (root is None or not os.path.isdir(root)):
        raise DatasetLayoutError(root, "image folder does not exist", _FOLDER_LAYOUT)
    return timm_create_dataset(name, root=root, split=split, download=download, **kwargs)
