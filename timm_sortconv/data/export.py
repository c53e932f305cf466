"""Write a protocol's splits as image folders, so that timm's own ``train.py`` trains on them.

timm's ``train.py`` reads image folders (``ROOT/train/<class>/...`` and ``ROOT/validation/<class>/...``)
but knows neither the Outex test-suite lists nor the paper's seeded splits, and timm's folder reader
skips Outex's ``.ras`` images. This writes every item of the two splits exactly as this package's
data set returns it (after the protocol's resizing) as a lossless PNG::

    python -m timm_sortconv.data.export sortconv/nwpu45 --data-dir DATA/NWPU-RESISC45 --out nwpu_split \\
        --train-split train:200 --val-split test
    python train.py --device-modules timm_sortconv --model ri_resnet18 --data-dir nwpu_split ...
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict

from torch.utils.data import Dataset

__all__ = ["export_image_folder", "main"]


def export_image_folder(dataset: Dataset, folder, classes=None) -> int:
    """Saves every ``(PIL image, label)`` of ``dataset`` as ``folder/<class name>/<index>.png``.

    Args:
        dataset: a data set returning ``PIL`` images (its ``transform`` unset).
        folder: the split's folder (created).
        classes: class names by label; the data set's ``classes`` by default, else the label numbers.

    Returns:
        The number of images written.
    """
    folder = Path(folder)
    names = classes if classes is not None else getattr(dataset, "classes", None)
    width = len(str(len(dataset) - 1))
    made: Dict[int, Path] = {}
    for index in range(len(dataset)):
        image, label = dataset[index]
        if label not in made:
            made[label] = folder / (str(names[label]) if names is not None else f"{label:03d}")
            made[label].mkdir(parents=True, exist_ok=True)
        image.save(made[label] / f"{index:0{width}d}.png")
    return len(dataset)


def main(argv=None) -> None:
    from . import DATASETS, PREFIX, create_dataset

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=[PREFIX + d for d in DATASETS if d != "mnist_rot"], help="data set")
    parser.add_argument("--data-dir", required=True, metavar="DIR", help="the data set's folder")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write train/ and validation/ into")
    parser.add_argument("--train-split", default="train", metavar="NAME", help="split written to train/")
    parser.add_argument("--val-split", default="test", metavar="NAME",
                        help="split written to validation/ (default: test; for MNIST use validation)")
    args = parser.parse_args(argv)
    for split, folder in ((args.train_split, "train"), (args.val_split, "validation")):
        dataset = create_dataset(args.dataset, args.data_dir, split)
        count = export_image_folder(dataset, Path(args.out) / folder)
        print(f"{args.dataset} {split}: {count} images -> {Path(args.out) / folder}")


if __name__ == "__main__":
    main()
