"""NWPU-RESISC45 read from its class folders, with the paper's seeded per-class split.

Layout as distributed (``NWPU-RESISC45.rar``)::

    NWPU-RESISC45/
      airplane/airplane_001.jpg ... airplane_700.jpg
      airport/...
      ...                              45 class folders of 700 256x256 RGB images each

``root`` may be that folder or the folder that contains it. Classes are the folder names in sorted
order (as ``ImageFolder`` numbers them).

Split (Mo & Zhao, section III): in each class a permutation seeded by ``split_seed`` picks a training
pool of ``train_pool`` (400) images; the remaining images (300 per class) are the test set. The
smaller training sets take the first 300 or 200 images of the pool (``split="train:300"``), so every
training set size is tested on the same 13,500 images. Images are resized to ``image_size``
(128x128, bilinear with antialiasing) as in the paper.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch
from PIL import Image
from torch.utils.data import Dataset

from .common import DatasetLayoutError, parse_train_split

__all__ = ["NWPU45"]

NWPU_LAYOUT = """\
  ROOT/<class name>/<image>.jpg      one folder per class (45 for NWPU-RESISC45), 700 images each;
                                     ROOT may also be the folder that contains NWPU-RESISC45/"""
_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff"}


class NWPU45(Dataset):
    """NWPU-RESISC45 as ``image_size`` RGB ``PIL`` images and labels, split per class with a seed.

    Args:
        root: the ``NWPU-RESISC45`` folder of class folders, or its parent.
        split: ``"train"`` (``train_pool`` images per class), ``"train:N"`` (the first N of the pool,
            e.g. ``"train:300"``, ``"train:200"``) or ``"test"`` (the images outside the pool).
        train_pool: images per class reserved for training; the rest are the test set.
        split_seed: seed of the per-class permutations.
        image_size: side of the square the images are resized to.
        transform: applied to each ``PIL`` image (timm's loaders set it).
    """

    def __init__(self, root, split: str = "train", *, train_pool: int = 400, split_seed: int = 0,
                 image_size: int = 128, transform=None):
        accepted = "'train', 'train:N' (N images per class, N <= train_pool), 'test'"
        name, option = parse_train_split(split, "NWPU-RESISC45", accepted)
        if name not in ("train", "test"):
            raise ValueError(f"NWPU-RESISC45 split {split!r} is not accepted; accepted: {accepted}")
        per_class = train_pool
        if option is not None:
            if not option.isdigit() or not 0 < int(option) <= train_pool:
                raise ValueError(f"NWPU-RESISC45 split {split!r}: N must be a whole number from 1 to "
                                 f"train_pool={train_pool}")
            per_class = int(option)
        folder = self._find_folder(Path(root))
        class_dirs = sorted(d for d in folder.iterdir() if d.is_dir())
        self.root = folder
        self.split = split
        self.classes = [d.name for d in class_dirs]
        self.image_size = image_size
        generator = torch.Generator().manual_seed(split_seed)
        samples: List[Tuple[Path, int]] = []
        for label, class_dir in enumerate(class_dirs):
            files = sorted(f for f in class_dir.iterdir() if f.suffix.lower() in _IMAGE_SUFFIXES)
            if len(files) <= train_pool:
                raise DatasetLayoutError(class_dir, f"class folder has {len(files)} images, needs more than "
                                                    f"train_pool={train_pool} to leave a test set", NWPU_LAYOUT)
            order = torch.randperm(len(files), generator=generator).tolist()
            chosen = order[:per_class] if name == "train" else order[train_pool:]
            samples += [(files[i], label) for i in sorted(chosen)]
        self.samples = samples
        self.targets = [label for _, label in samples]
        self.transform = transform

    @staticmethod
    def _find_folder(root: Path) -> Path:
        if not root.is_dir():
            raise DatasetLayoutError(root, "NWPU-RESISC45 folder does not exist", NWPU_LAYOUT)
        for folder in (root / "NWPU-RESISC45", root):
            if folder.is_dir() and any(d.is_dir() for d in folder.iterdir()):
                return folder
        raise DatasetLayoutError(root, "no class folders found", NWPU_LAYOUT)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
        if image.size != (self.image_size, self.image_size):
            image = image.resize((self.image_size, self.image_size), Image.BILINEAR)
        if self.transform is not None:
            image = self.transform(image)
        return image, target

    def __repr__(self) -> str:
        return f"NWPU45(split={self.split!r}, {len(self)} images, {len(self.classes)} classes, root={str(self.root)!r})"
