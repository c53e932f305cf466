"""A training loader whose order is a pure function of (seed, epoch), so a run can resume mid-epoch.

timm's ``create_loader`` shuffles with a ``RandomSampler`` (or a ``DistributedSampler``) drawn from the
global random state and always starts an epoch at its first batch. Resuming a killed run exactly
needs two more things: the same order for an epoch whatever happened before, and a start part-way
through it. :class:`ResumableSampler` gives both; :func:`create_train_loader` is timm's training
loader (timm's transforms, ``fast_collate`` and ``PrefetchLoader``) built around it.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

__all__ = ["ResumableSampler", "create_train_loader"]


class ResumableSampler(Sampler[int]):
    """Shuffles ``num_items`` indices with a generator seeded by ``seed + epoch``, shards them over ranks.

    Each rank takes every ``num_replicas``-th index of the epoch's permutation, padded by wrapping
    around so that all ranks see equally many (as ``DistributedSampler`` does). ``set_epoch(epoch,
    start)`` selects the epoch and skips the first ``start`` indices of this rank's share, which is how
    a resumed run continues after the batches it had already trained on.

    Args:
        num_items: size of the data set.
        shuffle: permute (training) or keep the data set's order.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        num_replicas, rank: the distributed world (1 and 0 for one process).
    """

    def __init__(self, num_items: int, *, shuffle: bool = True, seed: int = 0, num_replicas: int = 1, rank: int = 0):
        if num_items < 1:
            raise ValueError("ResumableSampler needs a non-empty data set")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside the world of {num_replicas} processes")
        self.num_items = num_items
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.items_per_rank = math.ceil(num_items / num_replicas)
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Selects the epoch's order and skips the first ``start`` indices of this rank's share."""
        if not 0 <= start <= self.items_per_rank:
            raise ValueError(f"start {start} is outside this rank's {self.items_per_rank} items")
        self.epoch = epoch
        self.start = start

    def _rank_indices(self) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_items, generator=generator)
        else:
            order = torch.arange(self.num_items)
        padded = order.repeat(math.ceil(self.items_per_rank * self.num_replicas / self.num_items))
        return padded[: self.items_per_rank * self.num_replicas][self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rank_indices()[self.start:].tolist())

    def __len__(self) -> int:
        return self.items_per_rank - self.start


def create_train_loader(
        dataset: Dataset,
        input_size: Tuple[int, int, int],
        batch_size: int,
        *,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        num_workers: int = 0,
        use_prefetcher: bool = True,
        device: Optional[torch.device] = None,
        pin_memory: bool = False,
        mean=(0.5,),
        std=(0.5,),
        **transform_kwargs,
):
    """timm's training loader (``create_transform(is_training=True)``, ``fast_collate``, ``PrefetchLoader``)
    over a :class:`ResumableSampler`; call ``loader.sampler.set_epoch(epoch, start)`` before each epoch.

    Batches that would be incomplete are dropped, as timm drops them in training. ``transform_kwargs``
    go to :func:`timm.data.create_transform` (``no_aug``, ``interpolation``, ``hflip``, ...).
    """
    from timm.data import create_transform
    from timm.data.loader import PrefetchLoader, fast_collate

    if isinstance(dataset, IterableDataset):
        raise ValueError("the resumable training loader needs a map-style data set (indexable, with a length); "
                         f"{type(dataset).__name__} streams its items (timm's tfds/, wds/, hfids/ readers)")
    dataset.transform = create_transform(input_size, is_training=True, mean=mean, std=std,
                                         use_prefetcher=use_prefetcher, **transform_kwargs)
    sampler = ResumableSampler(len(dataset), shuffle=True, seed=seed, num_replicas=num_replicas, rank=rank)
    if sampler.items_per_rank < batch_size:
        raise ValueError(f"the training set gives each of {num_replicas} process(es) {sampler.items_per_rank} images, "
                         f"fewer than one batch of {batch_size}: lower the batch size or use more images")
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=fast_collate if use_prefetcher else None,
        pin_memory=pin_memory,
        drop_last=True,
        persistent_workers=False,
    )
    if use_prefetcher:
        loader = PrefetchLoader(loader, mean=mean, std=std, channels=input_size[0],
                                device=device or torch.device("cpu"))
    return loader
