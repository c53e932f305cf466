"""The command-line tools, runnable as ``python -m timm_sortconv.cli.<tool>`` or ``python scripts/<tool>.py``.

* :mod:`.train`: train any timm model (the SC zoo included) on timm's parts, resumable;
* :mod:`.validate`: accuracy of a model (and a baseline) over a rotation sweep, with table, CSV and plot;
* :mod:`.demo`: the main job: an SCNN and its plain twin trained on MNIST and swept over rotations;
* :mod:`.mnist_results`: one row of RESULTS.md (train, MNIST test, MNIST-rot), added to a results table;
* :mod:`.records`: those tables: one CSV per study, one row per finished job, shared safely between processes;
* :mod:`.model_cards`: the model cards of published weights, from those rows;
* :mod:`.invariance`: the feature-change sweep of models at random initialisation;
* :mod:`.push_to_hub`: publish trained weights (and their card) to the Hugging Face Hub, or bundle them.

:func:`run` is how each tool starts: a problem with the user's input (a missing data folder, a bad
option value, a model name timm does not know, ``--pretrained`` for a model without weights, a data set whose
images have other channels than the model takes) ends the process with one ``error:`` line, without a
traceback.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["CommandError", "KeyValueArgs", "add_data_args", "add_input_args", "check_input_channels",
           "check_model_name", "create_model_or_error", "key_value", "no_weights_message", "parse_key_values", "run",
           "unknown_model_message"]


class CommandError(Exception):
    """A problem with a tool's input that the user can fix; :func:`run` prints it as one line."""


def unknown_model_message(name: str) -> str:
    """What to tell a user who asked for ``name``, a model timm does not know: the registered names closest to
    it (``difflib`` over ``timm.list_models()``, this package's models included)."""
    import timm

    from .. import models  # noqa: F401  (registers the SC models with timm)

    closest = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
    return (f"unknown model {name!r}; closest: {', '.join(closest)}" if closest else
            f"unknown model {name!r}; no registered name is close (timm.list_models() lists them)")


def check_model_name(name: str) -> None:
    """Raises :class:`CommandError` with :func:`unknown_model_message` unless timm knows the architecture of
    ``name`` (a pretrained tag after a dot is allowed; ``hf-hub:`` and ``local-dir:`` names are not checked)."""
    import timm

    from .. import models  # noqa: F401  (registers the SC models with timm)

    if ":" not in name and not timm.is_model(name):
        raise CommandError(unknown_model_message(name.split(".")[0]))


def no_weights_message(name: str, option: str = "--pretrained") -> str:
    """What to tell a user who asked (with ``option``) for the pretrained weights of ``name``, a model that has
    none: the models whose weights are bundled (:func:`timm_sortconv.hub.bundled_models`)."""
    from ..hub import bundled_models

    return (f"{name} has no pretrained weights here; models with weights (bundled): {', '.join(bundled_models())}; "
            f"leave out {option} to start it at random initialisation")


def create_model_or_error(name: str, option: str = "--pretrained", **kwargs) -> torch.nn.Module:
    """``timm.create_model(name, **kwargs)``; timm's error for the pretrained weights of a model that has none
    becomes a :class:`CommandError` naming ``option``, the command-line option that asked for them (a tool with
    two models has two)."""
    from timm.models import create_model

    try:
        return create_model(name, **kwargs)
    except RuntimeError as error:
        if _NO_WEIGHTS.fullmatch(str(error)):
            raise CommandError(no_weights_message(name, option)) from None
        raise


def check_input_channels(dataset, dataset_name: str, model: str, data_config: dict, input_size_given: bool) -> None:
    """Raises :class:`CommandError` when the images of ``dataset`` (``PIL`` images, as every data set of
    :func:`timm_sortconv.data.create_dataset` gives them) have other channels than ``data_config``'s input size
    says (the model's input, which the loader normalises to), naming the option that fixes it: ``--in-chans``,
    or ``--input-size`` where the user gave that. ``model`` is the option and name, as ``--model NAME``.

    timm's image folders convert their images to the model's channels; the paper's data sets give theirs as
    they are (MNIST and Outex grayscale, NWPU RGB), where a model of the other kind fails on the first batch."""
    if len(dataset) == 0:
        return
    image = dataset[0][0]
    if not hasattr(image, "getbands"):
        return
    bands = len(image.getbands())
    channels, height, width = data_config["input_size"]
    if bands == channels:
        return
    fix = f"--input-size {bands} {height} {width}" if input_size_given else f"--in-chans {bands}"
    raise CommandError(f"{model} takes {channels} input channels but {dataset_name or 'the image folder'} has "
                       f"{bands}; pass {fix} to build it for {bands}-channel input, or a model that takes "
                       f"{bands} channel{'' if bands == 1 else 's'}")


# timm.create_model's errors for a name it does not know (timm/models/_factory.py, _registry.py), and for
# pretrained=True where the model's pretrained config names no weights (timm/models/_builder.py)
_UNKNOWN_MODEL = re.compile(r"Unknown model \((?P<name>[^()]+)\)")
_UNKNOWN_TAG = re.compile(r"Invalid pretrained tag \((?P<tag>[^()]+)\) for (?P<name>\S+?)\.?")
_NO_WEIGHTS = re.compile(r"No pretrained weights exist for (?P<name>.+?)\. Use `pretrained=False` for random init\.")


def _model_error(error: RuntimeError) -> Optional[str]:
    """The one-line message for timm's error about an unknown model name or pretrained tag, or about a model
    without pretrained weights, else None."""
    text = str(error)
    match = _NO_WEIGHTS.fullmatch(text)
    if match:
        return no_weights_message(match["name"])
    match = _UNKNOWN_MODEL.fullmatch(text)
    if match:
        return unknown_model_message(match["name"])
    match = _UNKNOWN_TAG.fullmatch(text)
    if match:
        import timm

        tags = [n.partition(".")[2] for n in timm.list_pretrained(match["name"] + ".*")]
        return (f"unknown pretrained tag {match['tag']!r} of {match['name']}; its tags: "
                + (", ".join(tags) if tags else "none"))
    return None


def run(main: Callable[[Optional[Sequence[str]]], object], argv: Optional[Sequence[str]] = None) -> None:
    """Runs ``main(argv)`` with timm's logging, turning input errors into ``error: ...`` and exit status 2.

    Input errors are :class:`CommandError`, a data folder in the wrong layout, and ``timm.create_model``'s
    errors for a model name (or pretrained tag) it does not know and for the pretrained weights of a model that
    has none, which every tool's model options reach."""
    from timm import utils

    from ..data import DatasetLayoutError

    utils.setup_default_logging()
    try:
        main(argv)
    except (CommandError, DatasetLayoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as error:
        message = _model_error(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except BrokenPipeError:
        # the reader of the output went away (``| head``): stop quietly, as command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def key_value(text: str) -> str:
    """argparse ``type`` of one ``KEY=VALUE`` item (``--model-kwargs`` and the like): checks its form, so that
    a malformed item is a usage error naming it, and returns it unchanged."""
    key, sep, _ = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def parse_key_values(items: Sequence[str]) -> dict:
    """``KEY=VALUE`` items as a dict; a value is a Python literal where it parses as one (``0.5``, ``(1, 2)``,
    ``None``), else the string (``polar``), as timm's ``--model-kwargs``."""
    import ast

    out = {}
    for item in items:
        key, _, value = key_value(item).partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


class KeyValueArgs(argparse.Action):
    """``nargs="*"`` action that stores :func:`parse_key_values` of the items (use with ``type=key_value``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, parse_key_values(values))


def add_data_args(group: argparse._ArgumentGroup) -> None:
    """The data-set options the training and evaluation tools share, with timm's names."""
    group.add_argument("--data-dir", metavar="DIR", help="data folder")
    group.add_argument("--dataset", metavar="NAME", default="",
                       help="sortconv/mnist, sortconv/mnist_rot, sortconv/outex12, sortconv/nwpu45, or a timm dataset "
                            "name (empty: image folder)")
    group.add_argument("--dataset-download", action="store_true", default=False,
                       help="download the data set if missing (MNIST, timm torch/ data sets)")
    group.add_argument("--class-map", default="", type=str, metavar="FILENAME", help="class map for image folders")


def add_input_args(group: argparse._ArgumentGroup) -> None:
    """The options that override a model's classes and its data config, with timm's names."""
    group.add_argument("--num-classes", type=int, default=None, metavar="N", help="classes (model default if unset)")
    group.add_argument("--in-chans", type=int, default=None, metavar="N", help="input channels (model default if unset)")
    group.add_argument("--input-size", default=None, nargs=3, type=int, metavar=("C", "H", "W"),
                       help="input channels, height and width")
    group.add_argument("--crop-pct", default=None, type=float, metavar="N",
                       help="evaluation centre crop fraction (1.0 for sortconv/ data sets, else the model's)")
    group.add_argument("--mean", type=float, nargs="+", default=None, metavar="MEAN", help="normalisation mean")
    group.add_argument("--std", type=float, nargs="+", default=None, metavar="STD", help="normalisation std")
    group.add_argument("--interpolation", default="", type=str, metavar="NAME", help="resize interpolation")
