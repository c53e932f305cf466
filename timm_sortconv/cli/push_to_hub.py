"""Publish one trained model to the Hugging Face Hub in timm's format, with its model card.

    python scripts/push_to_hub.py --model scnn_p_rs_7 --checkpoint output/train/scnn_p_rs_7/model_best.pth.tar \
        --repo-id ORG/scnn_p_rs_7.mnist                      # token from HF_TOKEN
    python scripts/push_to_hub.py --model scnn_p_rs_7 --checkpoint ... --dry-run out/scnn_p_rs_7

``--dry-run DIR`` writes exactly the folder that would be uploaded (``model.safetensors``,
``config.json``, ``README.md``) and uploads nothing; ``timm.create_model("local-dir:DIR")`` loads it.
``--bundle`` also copies the weights to ``<model>.safetensors`` in the package's ``timm_sortconv/weights/``
(or in ``--bundle-dir DIR``; default: ``$TIMM_SORTCONV_WEIGHTS_DIR`` if set), from where
``timm.create_model(model, pretrained=True)`` loads them without a network (weights outside the package
need ``TIMM_SORTCONV_WEIGHTS_DIR=DIR`` when loading).
"""
from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

import timm
from timm.models import load_checkpoint

from .. import models  # noqa: F401  (registers the models with timm)
from ..hub import WEIGHTS_NAME, bundled_weights_dir, push_folder, save_pretrained
from . import CommandError, check_model_name, run

# The clone's model_cards/ folder holds the cards (written by scripts/model_cards.py).
REPO_ROOT = Path(__file__).resolve().parents[2]
_logger = logging.getLogger("push_to_hub")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="registered model name, e.g. scnn_p_rs_7")
    p.add_argument("--checkpoint", required=True, help="checkpoint written by scripts/train.py (or a state dict)")
    p.add_argument("--num-classes", type=int, default=None, help="classes of the checkpoint (default: the model's)")
    p.add_argument("--in-chans", type=int, default=None, help="input channels of the checkpoint")
    p.add_argument("--model-card", default=None, help="Markdown card (default: model_cards/<model>.md)")
    p.add_argument("--repo-id", default=None, help="Hub repository ORG/NAME to upload to")
    p.add_argument("--dry-run", metavar="DIR", default=None, help="write the upload folder to DIR, upload nothing")
    p.add_argument("--bundle", action="store_true", help="also copy the weights into the bundled-weights folder")
    p.add_argument("--bundle-dir", type=Path, default=None,
                   help="bundled-weights folder for --bundle (default: $TIMM_SORTCONV_WEIGHTS_DIR, else "
                        "timm_sortconv/weights/); loading from another folder needs TIMM_SORTCONV_WEIGHTS_DIR")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", default=None)
    p.add_argument("--commit-message", default="Add model")
    args = p.parse_args(argv)
    if not args.repo_id and not args.dry_run and not args.bundle:
        p.error("give --repo-id to upload, --dry-run DIR to write the folder, or --bundle")
    if args.bundle_dir is not None and not args.bundle:
        p.error("--bundle-dir only says where --bundle copies the weights; add --bundle")
    return args


def main(argv=None) -> None:
    """Writes, bundles or uploads one model's folder (see ``--help``)."""
    args = parse_args(argv)
    check_model_name(args.model)  # a typo is named as such, not as a missing card
    card = Path(args.model_card) if args.model_card else REPO_ROOT / "model_cards" / f"{args.model}.md"
    if not card.is_file():
        raise CommandError(f"no model card at {card}; write one (see model_cards/) or pass --model-card")
    if not Path(args.checkpoint).is_file():
        raise CommandError(f"checkpoint {args.checkpoint} does not exist")
    kwargs = {k: v for k, v in (("num_classes", args.num_classes), ("in_chans", args.in_chans)) if v is not None}
    model = timm.create_model(args.model, pretrained=False, **kwargs)
    load_checkpoint(model, args.checkpoint, strict=True)
    model.eval()

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_pretrained(model, args.dry_run or tmp, model_card=card)
        _logger.info(f"{args.model}: wrote {', '.join(sorted(p.name for p in folder.iterdir()))} to {folder}")
        if args.bundle:
            target = (args.bundle_dir or bundled_weights_dir()) / f"{args.model}.safetensors"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / WEIGHTS_NAME, target)
            _logger.info(f"bundled weights at {target}")
        if args.repo_id and not args.dry_run:
            info = push_folder(folder, args.repo_id, private=args.private, revision=args.revision,
                               commit_message=args.commit_message)
            _logger.info(f"uploaded to {info}")


if __name__ == "__main__":
    run(main)
