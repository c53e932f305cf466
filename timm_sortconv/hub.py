"""Saving, publishing and loading SC weights in timm's Hugging Face Hub format.

A published model folder holds exactly what :func:`timm.models.save_for_hf` writes
(``model.safetensors`` and ``config.json`` with ``architecture``, ``model_args`` and the
``pretrained_cfg``) plus the model card as ``README.md``. ``timm.create_model("hf-hub:ORG/NAME")`` and
``timm.create_model("local-dir:/path")`` load such a folder; :func:`load_pretrained` does the same, for a
folder or a Hub repository, with errors that say what is wrong with the folder.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import List, Optional, Union

import timm
import torch
from timm.models import save_for_hf

__all__ = ["PretrainedLoadError", "HUB_ORG", "PACKAGE_WEIGHTS_DIR", "bundled_models", "bundled_weights_dir",
           "save_pretrained", "push_folder", "fill_hf_cache", "load_pretrained"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
README_NAME = "README.md"
PACKAGE_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_DIR_ENV = "TIMM_SORTCONV_WEIGHTS_DIR"
# Hugging Face organisation of the published weights: <model>.<tag> repositories (timm's naming).
HUB_ORG = "timm-sortconv"


class _NameTheWeights(logging.Filter):
    """timm's ``load_state_dict`` logs ``Loaded {key} from checkpoint '{path}'`` with the key the file keeps its
    weights under (``state_dict``, ``state_dict_ema``); a file that is the weights themselves, as every
    safetensors file (the bundled weights, a published folder's) is, has no key, and the line read
    ``Loaded  from checkpoint``. This filter on timm's logger says ``weights`` there."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Loaded  from checkpoint "):
            record.msg = "Loaded weights from checkpoint " + record.msg[len("Loaded  from checkpoint "):]
        return True


logging.getLogger("timm.models._helpers").addFilter(_NameTheWeights())


class PretrainedLoadError(RuntimeError):
    """A model folder or Hub repository that cannot be loaded, with the reason and the fix."""


def bundled_weights_dir() -> Path:
    """Folder holding the bundled MNIST SCNN weights (``<model>.safetensors``).

    The package's ``weights/`` folder (:data:`PACKAGE_WEIGHTS_DIR`), unless the environment variable
    ``TIMM_SORTCONV_WEIGHTS_DIR`` names another one: for weights kept outside an installed package, and
    for tests, which must not write into the package. The SCNN default cfgs read it once, when
    ``timm_sortconv`` is imported, so set it before that.
    """
    override = os.environ.get(WEIGHTS_DIR_ENV)
    return Path(override) if override else PACKAGE_WEIGHTS_DIR


def bundled_models() -> List[str]:
    """The names of the models whose weights are bundled (``<model>.safetensors`` in
    :func:`bundled_weights_dir`), sorted: those ``timm.create_model(name, pretrained=True)`` loads offline."""
    return sorted(path.stem for path in bundled_weights_dir().glob("*.safetensors"))


def save_pretrained(model: torch.nn.Module, out_dir: Union[str, Path], model_card: Optional[Union[str, Path]] = None,
                    data_config: Optional[dict] = None) -> Path:
    """Writes ``model.safetensors``, ``config.json`` and (if given) the model card as ``README.md``.

    This folder is exactly what :func:`push_folder` uploads, and ``local-dir:<out_dir>`` loads it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_for_hf(model, out_dir, safe_serialization=True, data_config=data_config)
    if model_card is not None:
        card = Path(model_card)
        if not card.is_file():
            raise FileNotFoundError(f"model card {card} does not exist; expected a Markdown file in model_cards/")
        shutil.copyfile(card, out_dir / README_NAME)
    return out_dir


def push_folder(folder: Union[str, Path], repo_id: str, *, token: Optional[str] = None, private: bool = False,
                commit_message: str = "Add model", revision: Optional[str] = None):
    """Uploads a folder made by :func:`save_pretrained` to ``repo_id`` (token from ``HF_TOKEN`` if not given)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token or os.environ.get("HF_TOKEN"), library_name="timm", library_version=timm.__version__)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message)


def fill_hf_cache(folder: Union[str, Path], repo_id: str, cache_dir: Union[str, Path],
                  revision: str = "main", commit: str = "0" * 40) -> Path:
    """Lays ``folder`` out as the Hugging Face cache would after downloading ``repo_id``.

    With ``HF_HUB_CACHE=cache_dir`` and ``HF_HUB_OFFLINE=1``, ``timm.create_model("hf-hub:" + repo_id)``
    then loads it without a network: for air-gapped machines, mirrors and tests.
    """
    repo_dir = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for item in Path(folder).iterdir():
        if item.is_file():
            shutil.copyfile(item, snapshot / item.name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)
    return snapshot


HF_HUB_PREFIX = "hf-hub:"


def _download(source: str) -> Path:
    """The cached snapshot folder of ``hf-hub:ORG/NAME[@REVISION]`` after downloading its config and weights
    through ``huggingface_hub`` (``HF_ENDPOINT``, ETag and revision checks, the ``HF_HUB_CACHE`` cache, served
    from that cache when the server cannot be reached), as ``timm.create_model`` does. A file the repository
    lacks is left for :func:`_check_folder` to name."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = source[len(HF_HUB_PREFIX):].partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PretrainedLoadError(f"{source!r} names no Hub repository; expected {HF_HUB_PREFIX}ORG/NAME[@REVISION]")
    folder = None
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            folder = Path(hf_hub_download(repo_id, name, revision=revision or None)).parent
        except LocalEntryNotFoundError as e:
            raise PretrainedLoadError(f"{source}: {name} could not be downloaded and is not in the Hugging Face "
                                      f"cache ({_first_line(e)})") from e
        except EntryNotFoundError:
            continue
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise PretrainedLoadError(f"{source}: {name} could not be downloaded ({_first_line(e)})") from e
    if folder is None:
        raise PretrainedLoadError(f"{source} holds neither {CONFIG_NAME} nor {WEIGHTS_NAME}; a model repository "
                                  "holds the folder save_pretrained writes")
    return folder


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_folder(folder: Path) -> dict:
    if not folder.is_dir():
        raise PretrainedLoadError(f"{folder} is not a folder; expected one holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        raise PretrainedLoadError(f"{config_file} is missing; a model folder holds {CONFIG_NAME} (timm's format, "
                                  f"written by save_pretrained) and {WEIGHTS_NAME}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise PretrainedLoadError(f"{config_file} is not valid JSON: {e}") from e
    arch = config.get("architecture")
    if arch is None:
        raise PretrainedLoadError(f"{config_file} names no 'architecture'; expected a registered timm model name")
    if arch not in timm.list_models():
        raise PretrainedLoadError(f"{config_file} names architecture {arch!r}, which is not a registered model; "
                                  f"timm_sortconv registers e.g. {', '.join(timm.list_models('scnn_p_rs_*'))}")
    if not (folder / WEIGHTS_NAME).is_file():
        raise PretrainedLoadError(f"{folder / WEIGHTS_NAME} is missing; the folder must hold the weights "
                                  f"as safetensors next to {CONFIG_NAME}")
    return config


def load_pretrained(folder: Union[str, Path], **kwargs) -> torch.nn.Module:
    """Builds the model a ``save_pretrained`` folder describes and loads its weights, checking the folder.

    ``folder`` is a folder, or ``hf-hub:ORG/NAME[@REVISION]`` for a Hub repository holding one (downloaded
    into the Hugging Face cache as ``timm.create_model`` downloads it; ``HF_ENDPOINT`` names the server).
    Equivalent to ``timm.create_model("local-dir:" + folder, **kwargs)`` (``"hf-hub:..."``), but a missing
    file, an unknown architecture, a corrupted safetensors file or weights of the wrong shape raise
    :class:`PretrainedLoadError` saying which, in the same words for a Hub repository as for a folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = _download(folder) if str(folder).startswith(HF_HUB_PREFIX) else Path(folder)
    config = _check_folder(folder)
    try:
        state_dict = load_file(folder / WEIGHTS_NAME)
    except (SafetensorError, OSError, ValueError) as e:
        raise PretrainedLoadError(f"{folder / WEIGHTS_NAME} is not a readable safetensors file ({e}); "
                                  "re-download or re-export it") from e
    model_args = {"num_classes": config.get("num_classes"), **config.get("model_args", {}), **kwargs}
    model = timm.create_model(config["architecture"], pretrained=False, **model_args)
    model_sd = model.state_dict()
    problems = [f"{k}: file {tuple(v.shape)} vs model {tuple(model_sd[k].shape)}"
                for k, v in state_dict.items() if k in model_sd and model_sd[k].shape != v.shape]
    missing = sorted(set(model_sd) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(model_sd))
    if problems or missing or unexpected:
        raise PretrainedLoadError(
            f"weights in {folder / WEIGHTS_NAME} do not fit architecture {config['architecture']!r} "
            f"({config.get('model_args', {})}): shape mismatches {problems[:5]}, missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}")
    model.load_state_dict(state_dict)
    model.pretrained_cfg = {**model.pretrained_cfg, **config.get("pretrained_cfg", {})}
    return model
