"""timm's data config, made right for the paper's data sets and for models built with ``in_chans``."""
from __future__ import annotations

from typing import Optional

__all__ = ["resolve_data_config"]


def resolve_data_config(args: dict, model=None, dataset: str = "", verbose: bool = False) -> dict:
    """:func:`timm.data.resolve_data_config`, with two corrections scripts need.

    - ``sortconv/`` data sets come at their protocol's size (MNIST 28x28, Outex and NWPU 128x128), so
      the evaluation crop defaults to the whole image (``crop_pct=1.0``) instead of the model's.
    - timm takes the input size, channels included, and a mean/std from the model's ``pretrained_cfg``
      unless ``input_size`` is given; a model built with ``in_chans`` (say 1 for a 3-channel timm model)
      then needs that many channels and as many statistics (the mean of the configured values, as
      timm's prefetcher does, when their number differs).

    Args:
        args: the command-line arguments as a dict (``vars(args)``), timm's keys.
        model: the model whose ``pretrained_cfg`` fills what ``args`` leaves unset.
        dataset: the ``--dataset`` name.
        verbose: log the resolved config.
    """
    from timm.data import resolve_data_config as timm_resolve_data_config

    from . import is_sortconv_dataset

    args = dict(args)
    if args.get("crop_pct") is None and is_sortconv_dataset(dataset):
        args["crop_pct"] = 1.0
    config = timm_resolve_data_config(args, model=model, verbose=verbose)
    in_chans: Optional[int] = args.get("in_chans")
    if in_chans is None or args.get("input_size") is not None:
        return config
    config["input_size"] = (in_chans, *config["input_size"][1:])
    for key in ("mean", "std"):
        values = tuple(config[key])
        if len(values) != in_chans:
            config[key] = values * in_chans if len(values) == 1 else (sum(values) / len(values),) * in_chans
    return config
