"""The peers and screening layers of the MNIST-rot ablation (``ablation.py``'s ``--model`` names).

Their packages are not dependencies of timm-sortconv: install them where you run the ablation, e.g.
``pip install e2cnn gmr-conv`` in a separate environment.

* ``e2cnn``: :class:`E2CNN`, an E(2)-CNN (Weiler & Cesa 2019, package ``e2cnn``) laid out as the SCNN: six
  rotation-equivariant convolutions of the group C_N (``rotations``, default 8) on regular fields, with as
  many channels as the SCNN's (``channels``, each ``N`` channels one field), kernels ``kernel_size`` (7)
  x4 then 3 x2, inner BatchNorm and ReLU, 2x2 max pooling after the second and fourth, then pooling over
  the group (invariant to C_N), global average pooling and a linear layer. ``canonicalize`` (``"moment2"``,
  ...) turns each input image first, as the SCNN's option does.
* ``orientmax:<model>`` and ``orientkey:<model>``: ``<model>`` (``scnn`` or a timm name; its SC layers
  must use an orbit sorting, ``sorting="c2"`` or ``"c4"``) with every ``SortConv2d`` replaced by
  :class:`OrientConv2d` with the same weights: no sorting, the window read as the SC layer samples it, the
  kernel applied in each turn of the sorting's group (2 or 4) and the turns pooled. ``orientmax`` keeps, per
  output channel, the largest of the turned responses (pooling over the group at every layer);
  ``orientkey`` keeps, at each position, all channels of the one turn whose summed response is largest
  (one choice per window, shared by the channels). Both are exactly invariant to the group's turns, as the
  orbit sorting is, and add no parameters. ``orientmax8:``/``orientkey8:`` (polar sampling) pool eight copies
  45 degrees apart, the kernel's weights moved along its rings: exactly invariant to quarter turns, and to
  45-degree turns up to the bilinear reading of the ring points, as ring sorting is. They test whether
  sorting each ring's values per channel (which discards, per channel, which of the turned samples was
  which) is what costs the orbit sortings against the E(2)-CNN.
* ``frames<pool><K>x<step>:<model>`` (``pool`` ``avg`` or ``max``, e.g. ``framesavg3x20:scnn``): ``<model>``,
  which must have ``canonicalize=``, read in ``K`` canonical frames: the image turned by minus its moment
  angle plus each of ``K`` offsets ``step`` degrees apart and centred on 0 (3x20: -20, 0, 20), the frames'
  globally pooled features averaged or maxed before the classifier (:class:`FrameAverage`). Each frame turns
  with the input, so the invariance of the canonical turn is kept; ``K`` forward passes, no parameters.
  It tests whether reading a weakly oriented digit near, not only at, its measured angle lowers what the
  turn costs.
* ``gmr:<timm model>``: that model with every ``k x k`` convolution (``k > 1``) replaced by GMR-Conv
  (``GMR_Conv.GMR_Conv2d``, Du et al. 2025: radially symmetric Gaussian-mixture-ring kernels), for stride-1
  convolutions.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from timm_sortconv import SortConv2d
from timm_sortconv.canonical import MomentCanonicalize2d, canonical_frame, create_canonicalizer, moment_angle
from timm_sortconv.cli import CommandError
from timm_sortconv.ops.geometry import ORBIT_SORTINGS, get_geometry, orbit_order
from timm_sortconv.rotation import rotate_each

__all__ = ["E2CNN", "FrameAverage", "MNIST_CFG", "OrientConv2d", "gmr_convert", "orient_convert"]

MNIST_CFG = {"mean": (0.1307,), "std": (0.3081,)}


class E2CNN(torch.nn.Module):
    """The ``e2cnn`` peer of the module docstring."""

    def __init__(self, rotations: int = 8, channels=(32, 32, 64, 64, 128, 128), kernel_size: int = 7,
                 num_classes: int = 10, canonicalize: Optional[str] = None):
        super().__init__()
        from e2cnn import gspaces, nn as enn

        self.canonicalize = create_canonicalizer(canonicalize)
        space = gspaces.Rot2dOnR2(N=rotations)
        self.in_type = field = enn.FieldType(space, [space.trivial_repr])
        layers = []
        for i, (width, k) in enumerate(zip(channels, (kernel_size,) * 4 + (3, 3))):
            if i in (2, 4):
                layers.append(enn.PointwiseMaxPool(field, 2))
            out = enn.FieldType(space, [space.regular_repr] * (width // rotations))
            layers += [enn.R2Conv(field, out, k, padding=k // 2, bias=False), enn.InnerBatchNorm(out),
                       enn.ReLU(out, inplace=True)]
            field = out
        layers.append(enn.GroupPooling(field))
        self.features = enn.SequentialModule(*layers)
        self.fc = torch.nn.Linear(channels[-1] // rotations, num_classes)
        self.pretrained_cfg = MNIST_CFG
        self.geometric_tensor = enn.GeometricTensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.geometric_tensor(self.canonicalize(x), self.in_type)).tensor
        return self.fc(x.mean((2, 3)))


class OrientConv2d(torch.nn.Module):
    """The ``orient*:`` layer of the module docstring, built from an SC layer ``conv``.

    The unsorted SC window is linear in the input, so applying the layer's weight to it is a convolution
    with an effective kernel: each sample's weight spread over the grid by the sample's bilinear taps
    (square sampling: the weight itself). ``turns`` copies of that kernel, turned by each multiple of
    ``360 / turns`` degrees, give ``turns`` responses per output channel in one ``conv2d``, and they are
    pooled. With 2 or 4 turns the copies are exact quarter/half turns of the kernel, which a turn of the input
    by as much permutes cyclically, so the pooled output is exactly invariant to it. With 8 (polar sampling
    only) a 45-degree turn moves every sample of ring ``r`` by ``r`` places along its circle: the second copy is
    the weights moved so along the rings, and copies two apart are exact quarter turns of each other; the
    pooled output is exactly invariant to quarter turns and invariant to 45-degree turns of the content up to
    the bilinear reading of the points, as ring sorting is.
    """

    def __init__(self, conv, pool: str, turns: Optional[int] = None):
        super().__init__()
        group = ORBIT_SORTINGS.get(conv.sorting)
        if group is None:
            raise CommandError(f"orient{pool}: the SC layers must use sorting='c2' or 'c4' (they name the layout of "
                               f"the samples), got sorting={conv.sorting!r}")
        turns = turns or group
        if turns not in (2, 4, 8) or (turns == 8 and conv.sampling != "polar"):
            raise CommandError(f"orient{pool}{turns}: the turns must be 2, 4 or 8, and 8 needs sampling='polar' "
                               f"(got sampling={conv.sampling!r})")
        if pool not in ("max", "key"):
            raise CommandError(f"orient{pool}: the pooling must be 'max' or 'key'")
        if conv.padding_mode != "zeros" or conv.stride != (1, 1) or conv.dilation != (1, 1):
            raise CommandError("orientmax/orientkey: only stride-1, undilated, zero-padded SC layers are converted")
        k = conv.kernel_size[0]
        geometry = get_geometry(k, conv.sampling, conv.sorting)
        self.turns, self.pool, self.padding, self.groups = turns, pool, conv.padding, conv.groups
        self.weight, self.bias = conv.weight, conv.bias
        # Slot s of the unsorted window multiplies weight[slot_to_grid[s]] and reads row-major taps
        # interpolation[s]: the effective row-major kernel is weight[..., slot_to_grid] @ interpolation.
        self.register_buffer("interpolation", geometry.interpolation.float(), persistent=False)
        # Turn 1 of eight (45 degrees) reads, in slot s, the weight of the slot r places back along s's ring
        # (r its radius), from the geometry's own layout: ring r's slots hold the angular indices orbit_order.
        orders = [list(range(k * k))]
        if turns == 8:
            ring_index = [(0, 0)] + [(r, j) for r in range(1, k // 2 + 1) for j in orbit_order(8 * r, group)]
            slot_of = {key: slot for slot, key in enumerate(ring_index)}
            orders.append([slot_of[(r, (j - r) % (8 * r) if r else 0)] for r, j in ring_index])
        self.register_buffer("slot_to_grid", geometry.slot_to_grid[torch.tensor(orders)], persistent=False)

    def effective_kernels(self) -> torch.Tensor:
        """``(turns * C_out, C_in / groups, k, k)``: the row-major kernel of each turn, turn by turn. The
        quarter turns are ``rot90`` of the first kernel (of the first two for eight turns), so that they
        are exact."""
        w = self.weight
        base = [(w.flatten(2)[:, :, order] @ self.interpolation.to(w.dtype)).view_as(w) for order in self.slot_to_grid]
        step = 4 // self.turns if self.turns < 8 else 1  # quarter turns between consecutive copies of one base
        kernels = [torch.rot90(base[t % len(base)], -(t // len(base)) * step, (2, 3)) for t in range(self.turns)]
        return torch.cat(kernels)

    def turned_responses(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, turns, C_out, H, W)``: the response to the kernel turned by ``t * 360 / turns`` degrees."""
        return F.conv2d(x, self.effective_kernels(), None, 1, self.padding, 1, self.groups).unflatten(1, (self.turns, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.turned_responses(x)
        if self.pool == "max":
            out = y.amax(1)
        else:
            best = y.sum(2).argmax(1)[:, None, None]  # (B, 1, 1, H, W): the turn with the largest summed response
            out = torch.gather(y, 1, best.expand(-1, 1, y.shape[2], -1, -1)).squeeze(1)
        return out if self.bias is None else out + self.bias[:, None, None]


def orient_convert(module: torch.nn.Module, pool: str, turns: Optional[int] = None) -> torch.nn.Module:
    """``module`` with every ``SortConv2d`` replaced by an :class:`OrientConv2d` with the same weights."""
    for name, child in module.named_children():
        if isinstance(child, SortConv2d):
            setattr(module, name, OrientConv2d(child, pool, turns))
        else:
            orient_convert(child, pool, turns)
    return module


class FrameAverage(torch.nn.Module):
    """``model`` read in several canonical frames of each image, its pooled features pooled over the frames.

    The image is turned by minus its moment angle plus each of ``offsets`` (degrees) instead of by minus the
    angle alone (``model.canonicalize`` is replaced by this), and the frames' globally pooled features are
    averaged (``pool="avg"``) or maxed (``"max"``) before the classifier. Every frame turns with the input, so
    the invariance of the canonical turn is kept; the offsets let the classifier depend less on the exact
    angle read from a weakly oriented digit. ``len(offsets)`` forward passes; no parameters.
    """

    def __init__(self, model: torch.nn.Module, offsets, pool: str) -> None:
        super().__init__()
        if not isinstance(getattr(model, "canonicalize", None), MomentCanonicalize2d):
            raise CommandError("frames: the model needs canonicalize= (e.g. canonicalize=moment2)")
        self.order = model.canonicalize.order
        self.padding_mode = model.canonicalize.padding_mode
        model.canonicalize = torch.nn.Identity()
        self.model = model
        self.offsets = [float(o) for o in offsets]
        self.pool = pool
        self.pretrained_cfg = getattr(model, "pretrained_cfg", MNIST_CFG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = canonical_frame(x, self.padding_mode)  # a non-square image: the frame its canonical turn is made in
        angle = moment_angle(x, self.order)
        frames = torch.cat([rotate_each(x, -(angle + o), self.padding_mode) for o in self.offsets])
        feats = self.model.forward_head(self.model.forward_features(frames), pre_logits=True)
        feats = feats.view(len(self.offsets), x.shape[0], -1)
        feats = feats.mean(0) if self.pool == "avg" else feats.amax(0)
        return self.model.head.fc(feats)


def gmr_convert(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its stride-1 ``k x k`` convolutions (``k > 1``) replaced by ``GMR_Conv2d``."""
    from GMR_Conv import GMR_Conv2d

    for name, child in module.named_children():
        if type(child) is torch.nn.Conv2d and child.kernel_size[0] > 1:
            if child.stride != (1, 1):
                raise SystemExit(f"gmr: {name} has stride {child.stride}; only stride-1 convolutions are converted")
            setattr(module, name, GMR_Conv2d(child.in_channels, child.out_channels, child.kernel_size,
                                             padding=child.padding, dilation=child.dilation, groups=child.groups,
                                             bias=child.bias is not None))
        else:
            gmr_convert(child)
    return module
