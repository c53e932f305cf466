"""Digit-like images drawn from a seed: data for demos and tests that must not depend on a data set."""
from __future__ import annotations

import torch

__all__ = ["synthetic_digits"]


def synthetic_digits(num_images: int, size: int = 28, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Digit-like images ``(N, 1, size, size)`` in ``[0, 1]``: one to three smooth pen strokes on a black
    background, drawn inside the central ``18/28`` of the canvas (MNIST's digits fill a 20x20 box). Deterministic
    for a ``seed``; made for demos and tests that must not depend on a data set.

    Example:
        >>> x = synthetic_digits(4)
        >>> x.shape, bool(x.min() >= 0), bool(x.max() <= 1)
        (torch.Size([4, 1, 28, 28]), True, True)
    """
    if num_images < 1 or size < 8:
        raise ValueError(f"need num_images >= 1 and size >= 8, got num_images={num_images}, size={size}")
    gen = torch.Generator().manual_seed(seed)
    box = 9.0 / 28.0 * size  # half-width of the box the strokes stay in
    width = 1.1 / 28.0 * size  # pen radius (Gaussian sigma) in pixels
    centre = (size - 1) / 2.0
    coords = torch.arange(size, dtype=torch.float64)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    t = torch.linspace(0, 1, 48, dtype=torch.float64).view(-1, 1)
    images = torch.zeros(num_images, 1, size, size, dtype=torch.float64)
    for n in range(num_images):
        num_strokes = int(torch.randint(1, 4, (1,), generator=gen))
        # quadratic Bezier strokes: start, control and end points in the box
        points = (torch.rand(num_strokes, 3, 2, generator=gen, dtype=torch.float64) * 2 - 1) * box + centre
        for start, control, end in points:
            curve = (1 - t) ** 2 * start + 2 * (1 - t) * t * control + t ** 2 * end  # (48, 2) as (y, x)
            dist2 = (yy.unsqueeze(-1) - curve[:, 0]) ** 2 + (xx.unsqueeze(-1) - curve[:, 1]) ** 2
            stroke = torch.exp(-dist2.min(dim=-1).values / (2 * width ** 2))
            images[n, 0] = torch.maximum(images[n, 0], stroke)
    return images.to(dtype)
