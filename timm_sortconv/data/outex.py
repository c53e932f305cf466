"""Outex_TC_00012 read from the original Outex test-suite folder, with the paper's protocol.

Layout of the test suite as distributed by the University of Oulu (``Outex_TC_00012.zip``)::

    Outex_TC_00012/
      images/000000.ras ... 009119.ras   128x128 grayscale (Sun raster; .bmp/.png/.tif copies also read)
      000/classes.txt                    first line: 24; then "<class name> <class index>" per line
      000/train.txt                      first line: 480; then "<image file> <class index>" per line
      000/test.txt                       first line: 4320; then "<image file> <class index>" per line
      001/...                            the same files for the second problem
      (classes.txt may also sit at the top level)

Problem ``000`` (TC12 "t") trains on the 480 ``inca`` images at 0 degrees and tests on the 4,320
``t184`` images; problem ``001`` (TC12 "h") has the same training images and tests on the 4,320
``horizon`` images. The lists carry the illuminant (by which list an image is in) but not the rotation
angle: within each class a test list holds 20 samples at each of the 9 angles 0, 5, 10, 15, 30, 45,
60, 75, 90 degrees. This loader takes the angle from the position within the class, angle after
angle (``angle_layout="angle-major"``: the first 20 entries of a class at 0 degrees, the next 20 at
5, ...); ``"sample-major"`` reads each sample's 9 angles as consecutive entries instead. The real
files could not be checked here (Outex is not downloadable from this machine): look at the images of
one class if in doubt.

The paper's protocol (Mo & Zhao, section III) combines both problems:

- training (``split="train"``): the 0-degree images under the chosen illuminants, 480 each:
  ``inca`` from ``000/train.txt``, ``t184`` and ``horizon`` from the 0-degree entries of
  ``000/test.txt`` and ``001/test.txt``. ``"train"`` takes all three (1,440 images),
  ``"train:inca+t184"`` 960 and ``"train:inca"`` 480;
- test (``split="test"``): the ``t184`` and ``horizon`` images at the 8 non-zero angles (7,680).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from PIL import Image
from torch.utils.data import Dataset

from .common import DatasetLayoutError, parse_train_split

__all__ = ["OutexTC12", "OUTEX_ANGLES", "OUTEX_ILLUMINANTS"]

OUTEX_ANGLES = (0, 5, 10, 15, 30, 45, 60, 75, 90)
OUTEX_ILLUMINANTS = ("inca", "t184", "horizon")
# Outex names the fluorescent illuminant TL84; the paper writes t184. Both are accepted.
_ILLUMINANT_ALIASES = {"tl84": "t184"}
OUTEX_LAYOUT = """\
  ROOT/images/000000.ras ...         (the suite's images; .bmp, .png or .tif copies are read too)
  ROOT/000/train.txt                 "<count>" then "<image file> <class index>" lines (inca, 0 degrees)
  ROOT/000/test.txt                  same format (t184, 9 angles)
  ROOT/001/test.txt                  same format (horizon, 9 angles)
  ROOT/000/classes.txt or ROOT/classes.txt   "<count>" then "<class name> <class index>" lines"""
_IMAGE_SUFFIXES = (".ras", ".bmp", ".png", ".tif", ".tiff")
_ANGLE_LAYOUTS = ("angle-major", "sample-major")


def _read_list(path: Path) -> List[Tuple[str, int]]:
    """Reads an Outex list: a count line, then ``<name> <index>`` lines."""
    if not path.is_file():
        raise DatasetLayoutError(path, "Outex list file is missing", OUTEX_LAYOUT)
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    try:
        count = int(lines[0][0])
        entries = [(fields[0], int(fields[1])) for fields in lines[1:]]
    except (IndexError, ValueError):
        raise DatasetLayoutError(path, "malformed Outex list (expected a count line, then '<name> <index>' lines)",
                                 OUTEX_LAYOUT) from None
    if count != len(entries):
        raise DatasetLayoutError(path, f"Outex list declares {count} entries but holds {len(entries)}", OUTEX_LAYOUT)
    return entries


def _angles_by_position(entries: Sequence[Tuple[str, int]], layout: str, path: Path) -> List[int]:
    """The rotation angle of each entry of a test list, from its position within its class."""
    positions: Dict[int, int] = {}
    counts: Dict[int, int] = {}
    for _, label in entries:
        counts[label] = counts.get(label, 0) + 1
    angles = []
    for _, label in entries:
        per_class = counts[label]
        if per_class % len(OUTEX_ANGLES):
            raise DatasetLayoutError(
                path, f"class {label} has {per_class} test images, not a multiple of the {len(OUTEX_ANGLES)} angles "
                      f"{OUTEX_ANGLES}", OUTEX_LAYOUT)
        samples = per_class // len(OUTEX_ANGLES)
        position = positions.get(label, 0)
        positions[label] = position + 1
        index = position // samples if layout == "angle-major" else position % len(OUTEX_ANGLES)
        angles.append(OUTEX_ANGLES[index])
    return angles


class OutexTC12(Dataset):
    """Outex_TC_00012 under the paper's protocol, as 128x128 grayscale ``PIL`` images and labels.

    Args:
        root: the ``Outex_TC_00012`` folder (see the module docstring for its layout).
        split: ``"train"`` (all three illuminants, 1,440 images), ``"train:ILLUMINANTS"`` with
            illuminants joined by ``+`` (``"train:inca"``, ``"train:inca+t184"``), or ``"test"`` (7,680).
        angle_layout: how a test list orders each class's 9 angles, ``"angle-major"`` or ``"sample-major"``.
        transform: applied to each ``PIL`` image (timm's loaders set it).

    Attributes:
        samples: ``(image path, class index)`` per item; ``illuminants`` and ``angles`` per item.
    """

    def __init__(self, root, split: str = "train", *, angle_layout: str = "angle-major", transform=None):
        accepted = "'train', 'train:inca', 'train:inca+t184' (any '+'-joined illuminants), 'test'"
        name, option = parse_train_split(split, "Outex_TC_00012", accepted)
        if name not in ("train", "test"):
            raise ValueError(f"Outex_TC_00012 split {split!r} is not accepted; accepted: {accepted}")
        if angle_layout not in _ANGLE_LAYOUTS:
            raise ValueError(f"angle_layout {angle_layout!r} is not accepted; accepted: {', '.join(_ANGLE_LAYOUTS)}")
        illuminants = tuple(_ILLUMINANT_ALIASES.get(i, i) for i in option.split("+")) if option else OUTEX_ILLUMINANTS
        unknown = [i for i in illuminants if i not in OUTEX_ILLUMINANTS]
        if unknown or len(set(illuminants)) != len(illuminants):
            raise ValueError(f"Outex_TC_00012 illuminants {option!r} are not accepted; accepted: "
                             f"'+'-joined distinct names from {', '.join(OUTEX_ILLUMINANTS)}")
        root = Path(root)
        if not (root / "images").is_dir():
            raise DatasetLayoutError(root, "not an Outex test-suite folder (no images/ folder)", OUTEX_LAYOUT)
        self.root = root
        self.split = split
        self.classes = self._read_classes(root)
        lists = {
            "inca": [(n, c, 0) for n, c in _read_list(root / "000" / "train.txt")],
            "t184": self._with_angles(root / "000" / "test.txt", angle_layout),
            "horizon": self._with_angles(root / "001" / "test.txt", angle_layout),
        }
        if name == "train":
            chosen = [(n, c, ill, a) for ill in illuminants for n, c, a in lists[ill] if a == 0]
        else:
            chosen = [(n, c, ill, a) for ill in ("t184", "horizon") for n, c, a in lists[ill] if a != 0]
        for _, label, _, _ in chosen:
            if not 0 <= label < len(self.classes):
                raise DatasetLayoutError(root, f"class index {label} is outside classes.txt's {len(self.classes)} "
                                               "classes", OUTEX_LAYOUT)
        self.samples = [(self._image_path(n), c) for n, c, _, _ in chosen]
        self.illuminants = [ill for _, _, ill, _ in chosen]
        self.angles = [a for _, _, _, a in chosen]
        self.targets = [c for _, c in self.samples]
        self.transform = transform

    @staticmethod
    def _read_classes(root: Path) -> List[str]:
        for path in (root / "000" / "classes.txt", root / "classes.txt"):
            if path.is_file():
                entries = _read_list(path)
                names = [""] * len(entries)
                for class_name, index in entries:
                    if not 0 <= index < len(entries):
                        raise DatasetLayoutError(path, f"class index {index} out of range 0..{len(entries) - 1}",
                                                 OUTEX_LAYOUT)
                    names[index] = class_name
                return names
        raise DatasetLayoutError(root, "Outex classes.txt is missing", OUTEX_LAYOUT)

    @staticmethod
    def _with_angles(path: Path, angle_layout: str) -> List[Tuple[str, int, int]]:
        entries = _read_list(path)
        angles = _angles_by_position(entries, angle_layout, path)
        return [(n, c, a) for (n, c), a in zip(entries, angles)]

    def _image_path(self, name: str) -> Path:
        path = self.root / "images" / name
        if path.is_file():
            return path
        for suffix in _IMAGE_SUFFIXES:
            candidate = path.with_suffix(suffix)
            if candidate.is_file():
                return candidate
        raise DatasetLayoutError(path, "Outex image listed but missing", OUTEX_LAYOUT)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("L")
        if self.transform is not None:
            image = self.transform(image)
        return image, target

    def __repr__(self) -> str:
        return f"OutexTC12(split={self.split!r}, {len(self)} images, root={str(self.root)!r})"
