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

__all__ = ["parse_rotations", "rotate", "rotate_each"]


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
    grid = _source_grid(h, w, torch.tensor([math.cos(theta)], dtype=torch.float64, device=images.device),
                        torch.tensor([math.sin(theta)], dtype=torch.float64, device=images.device))
    out = F.grid_sample(x, grid.to(compute_dtype), mode="bilinear", padding_mode="zeros", align_corners=True)
    if fill:
        out = out + fill
    return out.reshape(images.shape).to(images.dtype)


def _source_grid(h: int, w: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``grid_sample``'s grid (``align_corners=True``) that turns ``(H, W)`` maps counter-clockwise about
    their centre, one turn per entry of ``cos``/``sin`` (shape ``(N,)``): ``(N, H, W, 2)``, dtype of ``cos``."""
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    ys = torch.arange(h, dtype=cos.dtype, device=cos.device) - cy
    xs = torch.arange(w, dtype=cos.dtype, device=cos.device) - cx
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    cos, sin = cos.view(-1, 1, 1), sin.view(-1, 1, 1)
    # Output pixel (x, y) (y pointing down) reads the input at its rotation by -angle, which in
    # y-down coordinates is (x cos - y sin, x sin + y cos) for a counter-clockwise turn on screen.
    src_x = xx * cos - yy * sin
    src_y = xx * sin + yy * cos
    # the half sizes from the coordinates rather than Python's max, which a trace would keep as the traced size's
    return torch.stack((src_x / (-xs[0]).clamp_min(0.5), src_y / (-ys[0]).clamp_min(0.5)), dim=-1)


def rotate_each(images: torch.Tensor, angles: torch.Tensor, padding_mode: str = "zeros") -> torch.Tensor:
    """Each image of ``images`` ``(N, C, H, W)`` turned counter-clockwise about its centre by its own angle.

    The same turn as :func:`rotate` (centre, direction, bilinear interpolation), for a tensor ``angles``
    of ``N`` angles in degrees, in one ``grid_sample`` call; it is differentiable with respect to
    ``images``. No angle is special-cased: a quarter turn is interpolated too, which reproduces
    ``torch.rot90`` up to float rounding. ``padding_mode`` is ``grid_sample``'s: ``"zeros"``, ``"border"``
    (pixels from outside repeat the nearest edge pixel) or ``"reflection"``.

    Example:
        >>> x = torch.rand(2, 1, 6, 6)
        >>> out = rotate_each(x, torch.tensor([90.0, 30.0]))
        >>> torch.allclose(out[0], torch.rot90(x[0], 1, dims=(-2, -1)), atol=1e-5)
        True
        >>> torch.allclose(out[1:], rotate(x[1:], 30), atol=1e-5)
        True
    """
    if images.dim() != 4:
        raise ValueError(f"rotate_each expects images of shape (N, C, H, W), got {list(images.shape)}")
    if angles.dim() != 1 or angles.shape[0] != images.shape[0]:
        raise ValueError(f"rotate_each expects one angle per image: angles of shape ({images.shape[0]},), "
                         f"got {list(angles.shape)}")
    return _rotate_each(images, angles, padding_mode)


def _rotate_each(images: torch.Tensor, angles: torch.Tensor, padding_mode: str) -> torch.Tensor:
    """:func:`rotate_each` without the argument checks (TorchScript compiles this one)."""
    compute_dtype = images.dtype if images.dtype in (torch.float32, torch.float64) else torch.float32
    # The turn's cosine and sine in float64, except in an ONNX graph: onnxruntime before 1.24 (the newest for
    # Python 3.10) has no float64 Cos or Sin.
    angle_dtype = torch.float64
    if not torch.jit.is_scripting():  # TorchScript compiles no branch under this test
        if torch.onnx.is_in_onnx_export():
            angle_dtype = compute_dtype
    # on the images' device; plain arithmetic rather than torch.deg2rad, which ONNX export does not know
    theta = angles.to(device=images.device, dtype=angle_dtype) * (math.pi / 180.0)
    grid = _source_grid(images.shape[-2], images.shape[-1], torch.cos(theta), torch.sin(theta))
    out = F.grid_sample(images.to(compute_dtype), grid.to(compute_dtype), mode="bilinear",
                        padding_mode=padding_mode, align_corners=True)
    return out.to(images.dtype)


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
