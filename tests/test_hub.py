"""Publishing and loading weights: dry-run folders, local-dir:, an offline Hugging Face cache, bundled weights,
and clear errors for broken folders. Everything here is made by the test itself; nothing touches the network."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv.hub import PretrainedLoadError, fill_hf_cache, load_pretrained, save_pretrained

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "scnn_p_rs_3"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model with non-default weights, its checkpoint as train.py writes it, and a model card."""
    torch.manual_seed(0)
    model = timm.create_model(MODEL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        for name, buf in model.named_buffers():
            if name.endswith("running_mean"):
                buf.normal_()
    root = tmp_path_factory.mktemp("trained")
    checkpoint = root / "model_best.pth.tar"
    torch.save({"state_dict": model.state_dict(), "epoch": 3, "arch": MODEL}, checkpoint)
    card = root / "card.md"
    card.write_text("# test card\n")
    return model, checkpoint, card


def _logits(model, seed=1):
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(x)


@pytest.fixture(scope="module")
def dry_run(trained, tmp_path_factory):
    """The folder push_to_hub.py --dry-run writes, made by running the script."""
    _, checkpoint, card = trained
    out = tmp_path_factory.mktemp("dry") / MODEL
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "push_to_hub.py"), "--model", MODEL,
                    "--checkpoint", str(checkpoint), "--model-card", str(card), "--repo-id", "someone/x",
                    "--dry-run", str(out)], check=True, capture_output=True)
    return out


def test_dry_run_writes_timm_hub_folder(dry_run, trained):
    assert sorted(p.name for p in dry_run.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((dry_run / "config.json").read_text())
    assert config["architecture"] == MODEL
    assert config["num_classes"] == 10
    assert config["pretrained_cfg"]["input_size"] == [1, 28, 28]
    assert (dry_run / "README.md").read_text() == trained[2].read_text()


def test_local_dir_loads_same_logits(dry_run, trained):
    model = timm.create_model(f"local-dir:{dry_run}", pretrained=True)
    torch.testing.assert_close(_logits(model), _logits(trained[0]), rtol=0, atol=0)
    torch.testing.assert_close(_logits(load_pretrained(dry_run)), _logits(trained[0]), rtol=0, atol=0)


def test_hf_hub_loads_offline_from_filled_cache(dry_run, trained, tmp_path):
    cache = tmp_path / "hf_cache"
    fill_hf_cache(dry_run, "timm-sortconv-test/scnn_p_rs_3.mnist", cache)
    code = (
        "import timm, torch, timm_sortconv\n"
        "m = timm.create_model('hf-hub:timm-sortconv-test/scnn_p_rs_3.mnist', pretrained=True).eval()\n"
        "x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(1))\n"
        "torch.save({'logits': m(x).detach(), 'state_dict': m.state_dict()}, 'loaded.pt')\n"
    )
    # The fast backend is irrelevant to loading; switching it off keeps the child from building it.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf_home"),
           "TIMM_SORTCONV_DISABLE_FAST": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True)
    loaded = torch.load(tmp_path / "loaded.pt")
    expected = trained[0].state_dict()
    assert loaded["state_dict"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded["state_dict"][key], value), key
    # Another process may pick another backend or thread count: equal up to float32 rounding.
    torch.testing.assert_close(loaded["logits"], _logits(trained[0]), rtol=1e-4, atol=1e-5)


def _broken_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_weights_file(dry_run, tmp_path):
    folder = _broken_copy(dry_run, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(PretrainedLoadError, match="model.safetensors is missing"):
        load_pretrained(folder)


def test_missing_config(dry_run, tmp_path):
    folder = _broken_copy(dry_run, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(PretrainedLoadError, match="config.json is missing"):
        load_pretrained(folder)


def test_unknown_architecture(dry_run, tmp_path):
    folder = _broken_copy(dry_run, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architecture"] = "scnn_p_rs_9"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedLoadError, match="'scnn_p_rs_9', which is not a registered model"):
        load_pretrained(folder)


def test_wrong_architecture_shape_mismatch(dry_run, tmp_path):
    folder = _broken_copy(dry_run, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architecture"] = "scnn_p_rs_5"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedLoadError, match="do not fit architecture 'scnn_p_rs_5'.*shape mismatches"):
        load_pretrained(folder)


def test_corrupted_safetensors(dry_run, tmp_path):
    folder = _broken_copy(dry_run, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedLoadError, match="not a readable safetensors file"):
        load_pretrained(folder)


def test_save_pretrained_needs_existing_card(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="model card"):
        save_pretrained(trained[0], tmp_path / "x", model_card=tmp_path / "nope.md")


@pytest.fixture
def bundle_dir(tmp_path):
    """The folder push_to_hub.py --bundle-dir writes to; the bundled file is removed afterwards, pass or fail."""
    from timm_sortconv.hub import PACKAGE_WEIGHTS_DIR

    real = PACKAGE_WEIGHTS_DIR / f"{MODEL}.safetensors"
    if real.exists():
        pytest.skip(f"real bundled weights at {real}: not bundling test weights next to them")
    folder = tmp_path / "weights"
    yield folder
    (folder / f"{MODEL}.safetensors").unlink(missing_ok=True)


def test_bundled_weights_load_with_pretrained_offline(trained, bundle_dir, tmp_path):
    _, checkpoint, card = trained
    push = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "push_to_hub.py"), "--model", MODEL,
                           "--checkpoint", str(checkpoint), "--model-card", str(card), "--bundle",
                           "--bundle-dir", str(bundle_dir)], capture_output=True, text=True)
    assert push.returncode == 0, push.stderr
    assert (bundle_dir / f"{MODEL}.safetensors").is_file()
    code = (
        "import timm, torch, timm_sortconv\n"
        f"m = timm.create_model({MODEL!r}, pretrained=True)\n"
        "torch.save(m.state_dict(), 'loaded.pt')\n"
    )
    # The scnn default cfgs look for bundled weights when timm_sortconv is imported, so the child process
    # is where TIMM_SORTCONV_WEIGHTS_DIR takes effect.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "TIMM_SORTCONV_DISABLE_FAST": "1", "TIMM_SORTCONV_WEIGHTS_DIR": str(bundle_dir)}
    load = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert load.returncode == 0, load.stderr
    loaded = torch.load(tmp_path / "loaded.pt")
    expected = torch.load(checkpoint)["state_dict"]
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
