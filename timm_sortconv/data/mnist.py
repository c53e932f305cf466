"""MNIST read from its IDX files, with the paper's seeded 50k/10k train/validation split.

The four files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each optionally gzipped) are found in any of:

- ``root/`` itself (a folder holding the four files),
- ``root/raw/``,
- ``root/MNIST/raw/`` (torchvision's layout, also what ``download=True`` writes).

IDX format (LeCun et al.): a big-endian header ``0x00 0x00 <type=0x08 (ubyte)> <ndim>``, then ``ndim``
big-endian 32-bit sizes, then the data. Images are ``(N, 28, 28)`` uint8, labels ``(N,)`` uint8.
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .common import DatasetLayoutError

__all__ = ["MNIST", "find_mnist_folder", "mnist_sample_dir", "read_idx"]

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_SPLITS = ("train", "validation", "trainval", "test")
MNIST_LAYOUT = """\
  ROOT/train-images-idx3-ubyte[.gz]      (or ROOT/raw/..., or ROOT/MNIST/raw/... as torchvision writes it)
  ROOT/train-labels-idx1-ubyte[.gz]
  ROOT/t10k-images-idx3-ubyte[.gz]
  ROOT/t10k-labels-idx1-ubyte[.gz]"""
_DOWNLOAD_HINT = "\nPass download=True (--dataset-download) to fetch the files into ROOT/MNIST/raw/ when online."

_IDX_UBYTE = 0x08


def mnist_sample_dir() -> Path:
    """The MNIST sample shipped in the package: the first 6,000 training and 500 test images (CC BY-SA 3.0,
    see the folder's README.md), enough for the demo and the examples to run with no data folder."""
    return Path(__file__).resolve().parent / "mnist_sample"


def read_idx(path) -> np.ndarray:
    """Reads an IDX file (gzipped or not) of unsigned bytes into an array of its declared shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DatasetLayoutError(path, f"cannot read IDX file ({e})", MNIST_LAYOUT) from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != _IDX_UBYTE:
        raise DatasetLayoutError(path, "not an IDX file of unsigned bytes (bad magic number)", MNIST_LAYOUT)
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise DatasetLayoutError(
            path, f"IDX file is truncated or padded: header declares shape {shape} ({expected} bytes), "
                  f"file has {len(data)} bytes", MNIST_LAYOUT)
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _find_file(folder: Path, name: str) -> Optional[Path]:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def find_mnist_folder(root, download_hint: bool = True) -> Path:
    """The folder under ``root`` that holds all four MNIST files, or a :class:`DatasetLayoutError`
    (which suggests ``--dataset-download`` if ``download_hint``)."""
    root = Path(root)
    hint = _DOWNLOAD_HINT if download_hint else ""
    if not root.is_dir():
        raise DatasetLayoutError(root, "MNIST folder does not exist", MNIST_LAYOUT + hint)
    names = [n for pair in MNIST_FILES.values() for n in pair]
    for folder in (root, root / "raw", root / "MNIST" / "raw"):
        if all(_find_file(folder, n) for n in names):
            return folder
    missing = [n for n in names if not any(_find_file(f, n) for f in (root, root / "raw", root / "MNIST" / "raw"))]
    raise DatasetLayoutError(
        root, f"MNIST files not found (missing: {', '.join(missing) or 'a complete set in one folder'})",
        MNIST_LAYOUT + hint)


def _download(root: Path) -> None:
    """Fetches the four files into ``root/MNIST/raw/``; on failure nothing is left behind, not even folders."""
    import shutil
    import tempfile

    from torchvision.datasets import MNIST as TorchvisionMNIST

    with tempfile.TemporaryDirectory(prefix="timm_sortconv_mnist_") as staging:
        try:
            TorchvisionMNIST(staging, train=True, download=True)
            TorchvisionMNIST(staging, train=False, download=True)
        except Exception as e:  # any network or mirror failure: say where the files should go instead
            raise DatasetLayoutError(root, f"MNIST download failed ({type(e).__name__}: {e}); place the files "
                                           "by hand", MNIST_LAYOUT) from None
        target = root / "MNIST" / "raw"
        target.mkdir(parents=True, exist_ok=True)
        for name in (n for pair in MNIST_FILES.values() for n in pair):
            shutil.move(str(Path(staging) / "MNIST" / "raw" / name), str(target / name))


def _load_pair(folder: Path, part: str) -> Tuple[np.ndarray, np.ndarray]:
    images_name, labels_name = MNIST_FILES[part]
    images = read_idx(_find_file(folder, images_name))
    labels = read_idx(_find_file(folder, labels_name))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DatasetLayoutError(
            folder, f"MNIST {part} files disagree: images {images.shape}, labels {labels.shape} "
                    "(expected (N, H, W) images and (N,) labels)", MNIST_LAYOUT)
    return images, labels


class MNIST(Dataset):
    """MNIST as 28x28 grayscale ``PIL`` images (mode ``"L"``) and integer labels.

    Splits follow the paper's protocol: ``"train"`` is 50,000 of the 60,000 training images,
    ``"validation"`` the other 10,000 (chosen by a seeded permutation, so every run and every model
    sees the same split), ``"trainval"`` all 60,000 and ``"test"`` the 10,000 test images. A smaller
    set of files (such as the sample in :func:`mnist_sample_dir`) is split in the same proportion.

    Args:
        root: folder with the IDX files (see the module docstring for the accepted layouts).
        split: ``"train"``, ``"validation"``, ``"trainval"`` or ``"test"``.
        validation_size: images held out of the training set for ``"validation"`` (default: one in six,
            the paper's 10,000 of 60,000).
        split_seed: seed of the train/validation permutation.
        download: fetch the files into ``root/MNIST/raw/`` when they are missing (needs a network).
        transform: applied to each ``PIL`` image (timm's loaders set it).

    Example:
        >>> ds = MNIST(mnist_sample_dir(), split="validation")  # the package's sample; a full MNIST folder alike
        >>> image, label = ds[0]; image.size, image.mode, len(ds)  # one in six of the sample's 6,000 training images
        ((28, 28), 'L', 1000)
    """

    classes = tuple(str(d) for d in range(10))

    def __init__(self, root, split: str = "train", *, validation_size: Optional[int] = None, split_seed: int = 0,
                 download: bool = False, transform=None):
        if split not in MNIST_SPLITS:
            raise ValueError(f"MNIST split {split!r} is not accepted; accepted: {', '.join(MNIST_SPLITS)}")
        root = Path(os.path.expanduser(str(root)))
        try:
            folder = find_mnist_folder(root)
        except DatasetLayoutError:
            if not download:
                raise
            _download(root)
            folder = find_mnist_folder(root, download_hint=False)
        images, labels = _load_pair(folder, "test" if split == "test" else "train")
        if split in ("train", "validation"):
            if validation_size is None:
                validation_size = len(images) // 6
            if not 0 < validation_size < len(images):
                raise ValueError(f"validation_size must be between 1 and {len(images) - 1}, got {validation_size}")
            order = torch.randperm(len(images), generator=torch.Generator().manual_seed(split_seed)).numpy()
            held_out = np.sort(order[:validation_size])
            kept = np.sort(order[validation_size:])
            selected = held_out if split == "validation" else kept
            images, labels = images[selected], labels[selected]
        self.root = folder
        self.split = split
        self.images = torch.from_numpy(np.array(images))  # a writable copy of the read-only buffer
        self.targets = torch.from_numpy(labels.astype(np.int64))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.images[index].numpy())
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])

    def __repr__(self) -> str:
        return f"MNIST(split={self.split!r}, {len(self)} images, root={str(self.root)!r})"
