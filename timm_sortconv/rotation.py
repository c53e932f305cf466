"""Rotating images about their centre: the one operation behind MNIST-rot and every rotation sweep.

:func:`rotate` turns a batch of image tensors counter-clockwise about the middle of the pixel grid
(bilinear, zero fill; multiples of 90 degrees of square images are exact ``torch.rot90``), and
:func:`parse_rotations` reads a list of angles from the command line. The rotated data sets
(:class:`timm_sortconv.data.RotatedDataset`) and the invariance measurements
(:mod:`timm_sortconv.invariance`) both import them from here.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["parse_rotations", "rotate"]


def rotate(images: torch.Tensor, angle: float, fill: float = 0.0) -> torch.Tensor:
    """``images`` rotated counter-clockwise by ``angle`` degrees about their centre.

    The centre is the middle of the pixel grid, ``((H - 1) / 2, (W - 1) / 2)``, so a square image turned
    by 90 degrees lands exactly on its own grid: multiples of 90 degrees of square images are returned
    by :func:`torch.rot90` (bit-exact, any dtype), and agree with the bilinear path at nearby angles.
    Other angles use bilinear interpolation; output pixels whose source lies outside the image take
    ``fill`` (blended bilinearly at the border), and the output keeps the input's size. The result is
    deterministic and each image is rotated independently of the rest of the batch.

    Args:
        images: ``(..., H, W)`` tensor, e.g. ``(N, C, H, W)``; floating point unless ``angle`` is a
            multiple of 90 degrees (and, for non-square images, of 180 degrees).
        angle: degrees, counter-clockwise as displayed (row 0 at the top), the convention of
            ``torch.rot90(images, 1, dims=(-2, -1))`` and of torchvision.
        fill: value of the pixels rotated in from outside the image.

    Returns:
        Tensor of the same shape, dtype and device.

    Example:
        >>> x = torch.arange(16.).view(1, 1, 4, 4)
        >>> torch.equal(rotate(x, 90), torch.rot90(x, 1, dims=(-2, -1)))
        True
        >>> rotate(x, 30).shape
        torch.Size([1, 1, 4, 4])
    """
    if not isinstance(images, torch.Tensor) or images.dim() < 2:
        raise ValueError(f"rotate expects a tensor of shape (..., H, W), got "
                         f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}")
    angle = float(angle)
    if not math.isfinite(angle):
        raise ValueError(f"angle must be a finite number of degrees, got {angle}")
    h, w = images.shape[-2:]
    quarters = angle / 90.0
    if quarters == round(quarters) and (h == w or round(quarters) % 2 == 0):
        return torch.rot90(images, int(round(quarters)) % 4, dims=(-2, -1)).clone()
    if not images.is_floating_point():
        raise TypeError(f"rotating by {angle} degrees interpolates and needs a floating-point tensor, got {images.dtype}")
    if h < 2 or w < 2:
        raise ValueError(f"rotate needs images of at least 2x2 pixels, got {h}x{w}")

    compute_dtype = images.dtype if images.dtype in (torch.float32, torch.float64) else torch.float32
    x = images.reshape(1, -1, h, w).to(compute_dtype)
    if fill:
        x = x - fill
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    ys = torch.arange(h, dtype=torch.float64, device=images.device) - cy
    xs = torch.arange(w, dtype=torch.float64, device=images.device) - cx
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    # Output pixel (x, y) (y pointing down) reads the input at its rotation by -angle, which in
    # y-down coordinates is (x cos - y sin, x sin + y cos) for a counter-clockwise turn on screen.
    src_x = xx * cos - yy * sin
    src_y = xx * sin + yy * cos
    grid = torch.stack((src_x / cx, src_y / cy), dim=-1).unsqueeze(0).to(compute_dtype)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    if fill:
        out = out + fill
    return out.reshape(images.shape).to(images.dtype)


def parse_rotations(spec: Union[str, Sequence[float]]) -> List[float]:
    """Angles in degrees from ``"START:STOP:STEP"`` (stop excluded, like ``range``), ``"a,b,c"`` or a list.

    >>> parse_rotations("0:360:90")
    [0.0, 90.0, 180.0, 270.0]
    >>> parse_rotations("0,45")
    [0.0, 45.0]
    """
    if not isinstance(spec, str):
        return [float(a) for a in spec]
    accepted = "accepted: 'START:STOP:STEP' (e.g. '0:360:10') or a comma-separated list (e.g. '0,45,90')"
    try:
        if ":" in spec:
            parts = [float(p) for p in spec.split(":")]
            if len(parts) != 3 or parts[2] <= 0 or parts[1] <= parts[0]:
                raise ValueError
            start, stop, step = parts
            return [float(a) for a in np.arange(start, stop - step * 1e-9, step)]
        angles = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"cannot read rotations {spec!r}; {accepted}") from None
    if not angles:
        raise ValueError(f"no rotation angles in {spec!r}; {accepted}")
    return angles
