"""Pieces shared by the data sets: the layout error, split names and a capped subset."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["DatasetLayoutError", "SubsetDataset", "cap_samples", "parse_train_split"]


class DatasetLayoutError(ValueError):
    """A data folder that is missing or does not have the layout a loader expects.

    The message names the folder (or file) and shows the layout that is accepted.
    """

    def __init__(self, path, problem: str, layout: str):
        super().__init__(f"{problem}: {path}\nExpected layout:\n{layout.rstrip()}")
        self.path = path


class SubsetDataset(Dataset):
    """The items of ``dataset`` at ``indices``, forwarding ``transform`` to it.

    ``torch.utils.data.Subset`` hides the base data set's ``transform``, which timm's loaders set
    after the data set is built; this subset passes it through so a capped data set loads like the
    whole one.
    """

    def __init__(self, dataset: Dataset, indices: Sequence[int]):
        self.dataset = dataset
        self.indices = [int(i) for i in indices]

    @property
    def transform(self):
        return self.dataset.transform

    @transform.setter
    def transform(self, value):
        self.dataset.transform = value

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.dataset[self.indices[index]]

    def __repr__(self) -> str:
        return f"SubsetDataset({len(self)} of {self.dataset!r})"


def cap_samples(dataset: Dataset, num_samples: Optional[int], seed: int = 0) -> Dataset:
    """A seeded random selection of ``num_samples`` items of ``dataset`` (kept in their order).

    ``None`` or a number at least the data set's size returns ``dataset`` itself. The same seed always
    selects the same items, so two models trained on a slice see the same images.
    """
    if num_samples is None or num_samples >= len(dataset):
        return dataset
    if num_samples < 1:
        raise ValueError(f"num_samples must be a positive number of items, got {num_samples}")
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(len(dataset), generator=generator)[:num_samples].sort().values
    return SubsetDataset(dataset, indices.tolist())


def parse_train_split(split: str, dataset_name: str, accepted: str):
    """Splits ``"train"`` or ``"train:OPTION"`` into ``("train", "OPTION" or None)``; other names pass through."""
    name, _, option = split.partition(":")
    if option and name != "train":
        raise ValueError(f"{dataset_name}: split {split!r} is not accepted; accepted: {accepted}")
    return name, (option or None)
