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
from timm_sortconv.hub import (
    HUB_ORG,
    PretrainedLoadError,
    bundled_weights_dir,
    fill_hf_cache,
    load_pretrained,
    save_pretrained,
)

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


@pytest.mark.slow
def test_dry_run_writes_timm_hub_folder(dry_run, trained):
    assert sorted(p.name for p in dry_run.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((dry_run / "config.json").read_text())
    assert config["architecture"] == MODEL
    assert config["num_classes"] == 10
    assert config["pretrained_cfg"]["input_size"] == [1, 28, 28]
    assert (dry_run / "README.md").read_text() == trained[2].read_text()


@pytest.mark.slow
def test_local_dir_loads_same_logits(dry_run, trained):
    model = timm.create_model(f"local-dir:{dry_run}", pretrained=True)
    torch.testing.assert_close(_logits(model), _logits(trained[0]), rtol=0, atol=0)
    torch.testing.assert_close(_logits(load_pretrained(dry_run)), _logits(trained[0]), rtol=0, atol=0)


@pytest.mark.slow
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
    """The folder push_to_hub.py --bundle-dir writes to (a temporary one: never the package's own)."""
    folder = tmp_path / "weights"
    yield folder
    (folder / f"{MODEL}.safetensors").unlink(missing_ok=True)


@pytest.mark.slow
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


SHIPPED = sorted(p.stem for p in bundled_weights_dir().glob("*.safetensors"))


def test_the_headline_weights_ship_in_the_package():
    assert {"scnn_p_rs_7", "scnn_baseline_7"} <= set(SHIPPED)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_weights_declare_their_hub_repo_and_load_offline(name):
    from safetensors.torch import load_file

    cfg = timm.models.get_pretrained_cfg(name)
    assert cfg.hf_hub_id == f"{HUB_ORG}/{name}.mnist"
    assert Path(cfg.file) == bundled_weights_dir() / f"{name}.safetensors"
    # timm takes the bundled file before the Hub (nothing is downloaded) and gives exactly the file's tensors.
    model = timm.create_model(name, pretrained=True).eval()
    shipped = load_file(bundled_weights_dir() / f"{name}.safetensors")
    assert shipped.keys() == model.state_dict().keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in shipped.items())
    # Trained weights, not an initialisation: the BatchNorm statistics moved away from (0, 1).
    assert any(k.endswith("running_var") and not torch.allclose(v, torch.ones_like(v)) for k, v in shipped.items())
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(torch.cat([x, torch.rot90(x, 1, (2, 3))]))
    if "baseline" not in name:  # an SCNN is exactly invariant to quarter turns, with any weights
        torch.testing.assert_close(logits[:4], logits[4:], rtol=1e-4, atol=1e-4)


def _table(path, *rows):
    """``path``, a table of ``rows`` as scripts/mnist_results.py writes it (one row per name)."""
    from timm_sortconv.cli.mnist_results import records

    for row in rows:
        records(path).put(row)
    return path


def _row(model, **extra):
    angles = [10.0 * i for i in range(36)]
    row = dict(name=model, model=model, model_kwargs=[], config="scripts/configs/mnist_scnn_short.yaml", epochs=1,
               seed=42, train_minutes=3.5, best_epoch=0, best_val_top1=97.5, mnist_test_top1=97.61,
               mnist_rot_top1=91.234, mnist_rot_images=2000, angles=angles,
               per_angle_top1=[90.0 + i / 10 for i in range(36)], eval_minutes=1.0,
               commands=["python scripts/train.py ...", "python scripts/validate.py --dataset sortconv/mnist ...",
                         "python scripts/validate.py --dataset sortconv/mnist_rot --checkpoint /my/runs/x/best.pth"],
               reproduce=f"python scripts/mnist_results.py --model {model} --data-dir DATA --runs /my/runs")
    row.update(extra)
    return row


@pytest.mark.slow
def test_model_cards_say_what_was_measured(tmp_path):
    repeating = [90.0 + i / 10 for i in range(9)] * 4
    sweep = _table(tmp_path / "sweep.csv", _row("scnn_p_rs_7"), _row("scnn_s_gs_3"))
    others = _table(tmp_path / "others.csv", _row("scnn_p_rs_7", name="x", model_kwargs=["downsample=avg"]),
                    _row("scnn_p_rs_7", name="long", epochs=5, mnist_rot_top1=95.5, mnist_rot_images=10000,
                         per_angle_top1=repeating))
    out = tmp_path / "cards"
    # every row of one table, one row of another by name, and a --hub-row that wins over both
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "model_cards.py"), str(sweep), f"{others}:x",
                    "--hub-row", f"{others}:long", "--out", str(out)], check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["scnn_p_rs_7.md", "scnn_s_gs_3.md"]  # kwargs rows: no card
    card = (out / "scnn_p_rs_7.md").read_text()
    assert card.startswith("---\nlibrary_name: timm\nlicense: apache-2.0")
    # the --hub-row run (5 epochs, the full 360,000 images) is the one described, beside the paper's figures
    assert "| MNIST-rot | 95.50% | 95.05% |" in card and "| MNIST test (10,000 images) | 97.61% | 99.04% |" in card
    assert "5 epochs, batch 50" in card and "360,000 images" in card and "rings of 8, 16, 24 values" in card
    assert "| angle | 90 |" not in card and "is exactly the one shown" in card  # one quarter of repeating angles
    assert 'timm.create_model("scnn_p_rs_7", pretrained=True)' in card and "arXiv:2305.14462" in card
    # commands name no machine's folders
    assert "/my/runs" not in card and "--checkpoint output/mnist/x/best.pth" in card
    assert "`python scripts/mnist_results.py --model scnn_p_rs_7 --data-dir DATA/mnist`" in card
    assert f"{sum(p.numel() for p in timm.create_model('scnn_p_rs_7').parameters()):,} parameters" in card
    other = (out / "scnn_s_gs_3.md").read_text()
    assert "| MNIST-rot | 91.23% | not reported |" in other and "2,000 of the 10,000 test images" in other
    assert "| top-1 % | 90.00 | 90.10 | 90.20 |" in other and "| angle | 0 | 10 | 20 |" in other
    assert "| angle | 270 |" in other and "is exactly the one shown" not in other  # made-up numbers: no repeats


def test_model_cards_refuse_what_is_not_a_row_of_a_table_in_one_line(tmp_path):
    """A JSON row of the older mnist_results.py, a missing table, an empty one and a name it lacks: each refused
    with what is wrong, before any card is written."""
    from timm_sortconv.cli import CommandError, model_cards

    old = tmp_path / "scnn_p_rs_7.json"
    old.write_text(json.dumps(_row("scnn_p_rs_7"), indent=1))
    table = _table(tmp_path / "rows.csv", _row("scnn_p_rs_7"))
    empty = tmp_path / "empty.csv"
    empty.write_text("name,model\n")
    refusals = {str(old): "is not a table of scripts/mnist_results.py", str(tmp_path / "no.csv"): "does not exist",
                str(empty): "empty.csv has no rows", f"{table}:scnn_s_rs_7": "rows.csv has no row scnn_s_rs_7"}
    for spec, message in refusals.items():
        with pytest.raises(CommandError, match=message):
            model_cards.main([spec, "--out", str(tmp_path / "cards")])
    assert not (tmp_path / "cards").exists()


@pytest.mark.slow
def test_card_of_the_paper_schedule_says_so(tmp_path):
    """A row trained on the paper's preset for its 100 epochs is described as the paper's schedule, with the
    hours its epochs ran, not as the short schedule that fits a CPU."""
    row = _table(tmp_path / "paper.csv",
                 _row("scnn_p_rs_7", epochs=100, config="scripts/configs/mnist_scnn.yaml",
                      train_args=["--log-interval", "50"],  # logging only: still the paper's schedule
                      train_minutes=510.0, best_epoch=52, best_val_top1=98.53, mnist_rot_images=10000))
    out = tmp_path / "cards"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "model_cards.py"), str(row), "--out", str(out)],
                   check=True, capture_output=True)
    card = (out / "scnn_p_rs_7.md").read_text()
    assert "the paper's schedule: 100 epochs, batch 100, Adam at 1e-4 times 0.8 every 10 epochs" in card
    assert "`scripts/configs/mnist_scnn.yaml`" in card and "8.5 hours" in card
    assert "after epoch 53 of 100 kept (validation top-1 98.53%)" in card and "**not** the paper's" not in card


@pytest.mark.slow
def test_card_of_the_early_sorting_model_names_its_partial_sorting_and_its_turn(tmp_path):
    row = _table(tmp_path / "early.csv", _row("scnn_p_rs_7_early_canon", epochs=5, mnist_rot_images=10000))
    out = tmp_path / "cards"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "model_cards.py"), str(row), "--out", str(out)],
                   check=True, capture_output=True)
    card = (out / "scnn_p_rs_7_early_canon.md").read_text()
    assert "Sorting Convolution in its first two layers" in card and "`sorted_convs=2`" in card
    assert "`canonicalize='moment1'`" in card and "principal axis" not in card
    assert "| the paper (scnn_p_rs_7, 100 epochs) |" in card and "rings of 8, 16, 24 values" in card


@pytest.mark.parametrize("card", sorted((REPO_ROOT / "model_cards").glob("scnn_*.md")), ids=lambda p: p.stem)
def test_every_card_describes_shipped_weights(card):
    assert card.stem in SHIPPED
    text = card.read_text()
    assert f"# {card.stem}.mnist" in text and f"timm.create_model(\"{card.stem}\", pretrained=True)" in text


def _sample_accuracy():
    """Top-1 of a model on the shipped sample's 500 test digits turned by an angle as MNIST-rot turns them."""
    from timm_sortconv.data import create_dataset, mnist_sample_dir
    from timm_sortconv.rotation import rotate

    data = create_dataset("sortconv/mnist", root=str(mnist_sample_dir()), split="test")
    x, y = data.images.unsqueeze(1).float() / 255.0, data.targets

    def accuracy(model, angle):
        with torch.no_grad():
            turned = rotate(x, angle).mul(255).round().div(255)  # 8-bit, as the MNIST-rot images
            return 100 * (model((turned - 0.1307) / 0.3081).argmax(1) == y).float().mean().item()
    return accuracy


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scnn_p_rs_7_canon", "scnn_p_c2_7_canon", "scnn_p_rs_7_early_canon"])
def test_shipped_canonical_models_are_flat_between_the_quarter_turns(name):
    """On the sample's 500 test digits, each bundled canonical model is as accurate at 30 and 45 degrees as
    upright (within 2 points), while the bundled ``scnn_p_rs_7`` (no canonical turn) loses more than twice
    as much at 45 degrees."""
    accuracy = _sample_accuracy()
    canon = timm.create_model(name, pretrained=True).eval()
    plain = timm.create_model("scnn_p_rs_7", pretrained=True).eval()
    upright = accuracy(canon, 0.0)
    assert upright > 95
    drops = [upright - accuracy(canon, a) for a in (30.0, 45.0)]
    assert max(drops) < 2.0, drops
    assert accuracy(plain, 0.0) - accuracy(plain, 45.0) > 2 * max(max(drops), 1.0)


@pytest.mark.slow
def test_shipped_c2_model_keeps_more_than_ring_sorting():
    """Half-turn orbit sorting keeps the direction the canonical turn fixes: the bundled ``scnn_p_c2_7_canon``
    is more accurate than ``scnn_p_rs_7_canon`` on the sample's digits, upright and at 45 degrees."""
    accuracy = _sample_accuracy()
    c2 = timm.create_model("scnn_p_c2_7_canon", pretrained=True).eval()
    ring = timm.create_model("scnn_p_rs_7_canon", pretrained=True).eval()
    for angle in (0.0, 45.0):
        assert accuracy(c2, angle) > accuracy(ring, angle), angle


@pytest.mark.slow
@pytest.mark.parametrize("model,sorting", [("scnn_p_rs_7_canon", "ring sorting (each ring's values sorted"),
                                           ("scnn_p_c2_7_canon", "half-turn orbit sorting (`sorting='c2'`")])
def test_model_cards_of_the_canonical_models_say_so(tmp_path, model, sorting):
    row = _table(tmp_path / "canon.csv", _row(model, mnist_rot_images=10000))
    out = tmp_path / "cards"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "model_cards.py"), str(row), "--out", str(out)],
                   check=True, capture_output=True)
    card = (out / f"{model}.md").read_text()
    assert "turned about its centre to its principal axis" in card and "canonicalize='moment2'" in card
    assert sorting in card and "rings of 8, 16, 24 values" in card
    # the paper has neither the turn nor orbit sorting: its P-RS-7 figures stand beside
    assert "| the paper (scnn_p_rs_7, 100 epochs) |" in card and "| MNIST-rot | 91.23% | 95.05% |" in card


@pytest.mark.slow
def test_card_of_weights_trained_on_from_the_bundled_ones_gives_both_stages(tmp_path):
    """A row trained with ``--pretrained`` started from the model's bundled weights: its card names the row
    that trained those (the row named after the model in the same table), both schedules and both commands."""
    first = _row("scnn_p_c2_7_canon", epochs=8, train_minutes=88.8, best_epoch=6, best_val_top1=98.99,
                 reproduce="python scripts/mnist_results.py --model scnn_p_c2_7_canon --epochs 8 --data-dir DATA")
    more = _row("scnn_p_c2_7_canon", name="scnn_p_c2_7_canon-ft4", epochs=4, train_minutes=44.0, best_epoch=3,
                best_val_top1=99.06, mnist_test_top1=99.02, train_args=["--pretrained", "--lr", "5e-4"],
                reproduce="python scripts/mnist_results.py --model scnn_p_c2_7_canon --name scnn_p_c2_7_canon-ft4 "
                          "--epochs 4 --data-dir DATA --pretrained --lr 5e-4")
    rows = _table(tmp_path / "rows.csv", more)
    command = [sys.executable, str(REPO_ROOT / "scripts" / "model_cards.py"), f"{rows}:scnn_p_c2_7_canon-ft4",
               "--out", str(tmp_path / "cards")]
    missing = subprocess.run(command, capture_output=True, text=True)
    assert missing.returncode == 2 and "has no row scnn_p_c2_7_canon (scnn_p_c2_7_canon-ft4 was trained on from " \
        "the bundled weights of scnn_p_c2_7_canon" in missing.stderr
    assert "Traceback" not in missing.stderr
    _table(rows, first)
    subprocess.run(command, check=True, capture_output=True)
    card = (tmp_path / "cards" / "scnn_p_c2_7_canon.md").read_text()
    assert "in two stages: 8 epochs of the preset" in card or "in two stages: 8 epochs, batch 50" in card
    assert "keeping its best epoch (6,\n  validation top-1 98.99%)" in card
    assert "then 4 more epochs of the same\n  preset from those weights (`--pretrained`) with `--lr 5e-4`" in card
    assert "88.8 + 44.0 minutes" in card and "| MNIST test (10,000 images) | 99.02% |" in card
    assert "`python scripts/mnist_results.py --model scnn_p_c2_7_canon --epochs 8 --data-dir DATA/mnist`, then" in card
    assert "--name scnn_p_c2_7_canon-ft4 --epochs 4 --data-dir DATA/mnist --pretrained --lr 5e-4`" in card
