"""Rotated copies of a data set, generated on the fly: the paper's MNIST-rot protocol.

MNIST-rot (Mo & Zhao, section III) is the MNIST test set with every image rotated by 0, 10, ..., 350
degrees: 36 subsets of 10,000 images, 360,000 in all. :class:`RotatedDataset` builds it (or the same
protocol for any image data set and any list of angles) without storing anything: item ``i`` is
image ``i % N`` of the base data set rotated by angle ``i // N``, so each angle's subset is one
contiguous block of indices. Rotation is :func:`timm_sortconv.rotation.rotate` (bilinear about the
image centre, zero fill, the same operation the invariance sweeps use), applied to the image's 8-bit
values and rounded back to 8 bits, so an item is an ordinary image that any timm transform accepts.
Angle 0 returns the base image unchanged.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..rotation import parse_rotations, rotate

__all__ = ["RotatedDataset", "MNIST_ROT_ANGLES", "parse_rotations", "rotate_image"]

MNIST_ROT_ANGLES = tuple(range(0, 360, 10))


def rotate_image(image: Image.Image, angle: float) -> Image.Image:
    """``image`` rotated by ``angle`` degrees about its centre (bilinear, zero fill), same mode and size."""
    if angle % 360 == 0:
        return image
    array = np.asarray(image)
    pixels = torch.from_numpy(np.array(array, dtype=np.float32))
    pixels = pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1)
    rotated = rotate(pixels.unsqueeze(0), float(angle))[0]
    rotated = rotated.round().clamp(0, 255).to(torch.uint8)
    rotated = rotated[0] if array.ndim == 2 else rotated.permute(1, 2, 0)
    return Image.fromarray(rotated.numpy())


class RotatedDataset(Dataset):
    """Every image of ``base`` at every angle of ``angles``; item ``i`` is image ``i % N`` at angle ``i // N``.

    Args:
        base: a data set of ``(PIL image, label)`` pairs with ``transform`` unset (rotation comes first).
        angles: rotation angles in degrees; the default is MNIST-rot's 0, 10, ..., 350.
        transform: applied to each rotated image (timm's loaders set it).
        round_trip: rotate each image by the angle and then back by minus the angle: upright again, but
            resampled twice. A control for a sweep: a model that loses as much on these images as on the
            rotated ones loses it to the resampling (blur, the 8-bit grid), not to the orientation.

    Example:
        >>> from timm_sortconv.data import MNIST, mnist_sample_dir
        >>> test = MNIST(mnist_sample_dir(), split="test")  # the package's sample: 500 test images
        >>> mnist_rot = RotatedDataset(test)
        >>> len(mnist_rot) == 36 * len(test), mnist_rot.angle_of(len(test))
        (True, 10.0)
        >>> len(mnist_rot.with_angles([90])) == len(test)
        True
    """

    def __init__(self, base: Dataset, angles: Iterable[float] = MNIST_ROT_ANGLES, transform=None,
                 round_trip: bool = False):
        if getattr(base, "transform", None) is not None:
            raise ValueError("RotatedDataset needs the base data set's transform unset: set the transform on the "
                             "RotatedDataset, so images are rotated before they are cropped and normalised")
        self.base = base
        self.angles = [float(a) for a in angles]
        if not self.angles:
            raise ValueError("RotatedDataset needs at least one angle")
        self.transform = transform
        self.round_trip = round_trip

    @property
    def num_images(self) -> int:
        """Images of the base data set (each one appears once per angle)."""
        return len(self.base)

    def __len__(self) -> int:
        return len(self.base) * len(self.angles)

    def angle_of(self, index: int) -> float:
        """The rotation angle of item ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        return self.angles[index // len(self.base)]

    @property
    def item_angles(self) -> torch.Tensor:
        """The angle of every item, in item order (a float64 tensor of length ``len(self)``)."""
        return torch.tensor(self.angles, dtype=torch.float64).repeat_interleave(len(self.base))

    def with_angles(self, angles: Iterable[float]) -> "RotatedDataset":
        """The same protocol restricted to (or extended to) ``angles``, sharing the base data set."""
        return RotatedDataset(self.base, angles, transform=self.transform, round_trip=self.round_trip)

    def __getitem__(self, index: int):
        angle = self.angle_of(index)
        image, target = self.base[index % len(self.base)]
        image = rotate_image(image, angle)
        if self.round_trip:
            image = rotate_image(image, -angle)
        if self.transform is not None:
            image = self.transform(image)
        return image, target

    def __repr__(self) -> str:
        kind = "angles (there and back)" if self.round_trip else "angles"
        return f"RotatedDataset({len(self.angles)} {kind} x {len(self.base)} images of {self.base!r})"
