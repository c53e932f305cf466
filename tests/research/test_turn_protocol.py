"""``scripts/research/turn_protocol.py``: each way of turning the test digits does what its description says
(the reference is MNIST-rot image for image; the others differ from it only in the one choice they name), and a
tiny network's measurement is the ablation sweep's, with paired differences that add up."""
import json

import numpy as np
import pytest
import timm
import torch
from test_data import make_mnist
from timm_sortconv.data import MNIST, RotatedDataset, mnist_sample_dir
from timm_sortconv.rotation import rotate


@pytest.fixture(scope="module")
def tp():
    import turn_protocol
    return turn_protocol


@pytest.fixture(scope="module")
def digits():
    test = MNIST(mnist_sample_dir(), split="test")  # the package's 500 real test digits
    return test, test.images[:60]


def rot90(x):
    return torch.rot90(x, 1, dims=(-2, -1))


@pytest.mark.parametrize("angle", [10, 45, 90, 200, 333.5])
def test_bilinear_is_mnist_rot_image_for_image(tp, digits, angle):
    test, images = digits
    expected = torch.stack([torch.from_numpy(np.array(RotatedDataset(test, [angle])[i][0]))
                            for i in range(len(images))]).float()
    assert torch.equal(tp.turn(images, angle, "bilinear"), expected)


@pytest.mark.parametrize("variant", ["bilinear", "torchvision", "bicubic", "float", "half-pixel"])
def test_every_variant_keeps_upright_digits_and_gives_eight_bit_values(tp, digits, variant):
    _, images = digits
    assert torch.equal(tp.turn(images, 0, variant), images.float())
    assert torch.equal(tp.turn(images, 360, variant), images.float())
    out = tp.turn(images, 30, variant)
    assert out.dtype == torch.float32 and out.shape == images.shape
    assert out.min() >= 0 and out.max() <= 255 + 1e-3  # float: a convex combination, up to float rounding
    if variant != "float":
        assert torch.equal(out, out.round())
    assert not torch.equal(out, images.float())


@pytest.mark.parametrize("variant", ["bilinear", "torchvision", "bicubic", "float"])
def test_variants_about_the_grids_middle_commute_with_quarter_turns(tp, digits, variant):
    _, images = digits
    assert torch.equal(tp.turn(images, 90, variant), rot90(images.float()))
    for angle in (10, 37.5, 45):
        changed = (tp.turn(images, angle + 90, variant) != rot90(tp.turn(images, angle, variant))).float().mean()
        # nearest neighbour breaks ties at exact half-pixel sources either way (about 1% of pixels at 45 degrees)
        assert changed <= (0.02 if variant == "torchvision" else 0.0)


def test_half_pixel_turns_about_a_point_half_a_pixel_off_the_middle(tp, digits):
    _, images = digits
    # turning about c = m + (1/2, 1/2) is turning about the middle m, then shifting by (I - R)(1/2, 1/2):
    # one row down for a quarter turn, one row and one column for a half turn (the edge row/column is filled)
    quarter, half = tp.turn(images, 90, "half-pixel"), tp.turn(images, 180, "half-pixel")
    assert torch.equal(quarter[:, 1:], rot90(images.float())[:, :-1])
    assert torch.equal(half[:, 1:, 1:], torch.rot90(images.float(), 2, dims=(-2, -1))[:, :-1, :-1])
    # the grid about the middle itself is rotate()'s turn (same direction, same centre)
    grid = tp._grid(28, 28, 30, 13.5, 13.5).float().expand(len(images), -1, -1, -1)
    middle = torch.nn.functional.grid_sample(images.float().unsqueeze(1), grid, mode="bilinear", align_corners=True)
    assert torch.allclose(middle[:, 0], rotate(images.float(), 30), atol=1e-3)


def test_torchvision_is_nearest_neighbour_and_float_is_bilinear_unrounded(tp, digits):
    _, images = digits
    nearest, exact, rounded = (tp.turn(images, 30, v) for v in ("torchvision", "float", "bilinear"))
    for image, out in zip(images, nearest):
        assert set(out.unique().tolist()) <= set(image.float().unique().tolist()) | {0.0}
    assert (exact - rounded).abs().max() <= 0.5
    assert not torch.equal(exact, rounded)


def test_bad_input_is_refused(tp, digits):
    _, images = digits
    with pytest.raises(ValueError, match="unknown variant 'lanczos'; accepted: bilinear, torchvision"):
        tp.turn(images, 30, "lanczos")
    with pytest.raises(ValueError, match="8-bit images of shape"):
        tp.turn(images.float(), 30, "bilinear")


def test_measurement_is_the_ablation_sweep_with_paired_differences(tp, tmp_path, capsys):
    import ablation
    data = tmp_path / "mnist"
    make_mnist(data, num_train=20, num_test=24)
    torch.manual_seed(0)
    model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4))
    checkpoint = tmp_path / "model.pth.tar"
    torch.save({"state_dict": model.state_dict(), "epoch": 0}, checkpoint)
    out = tmp_path / "turns.json"
    angles = [0.0, 45.0, 90.0]
    tp.main(["--data-dir", str(data), "--model", "scnn_p_rs_3", "--checkpoint", str(checkpoint), "--model-kwargs",
             "channels=(4,4,4,4,4,4)", "--samples", "16", "--angles", "0,45,90", "--variants", "float", "half-pixel",
             "-b", "5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["bilinear", "float", "half-pixel"]  # the reference always, first
    assert (result["images"], result["angles"]) == (16, angles)
    assert "--variants float half-pixel" in result["command"]
    reference = result["variants"]["bilinear"]
    sweep, labels = ablation.rotated_sweep(str(data), 16, angles, "")
    model.eval()
    expected = ablation.summarise(ablation.sweep_correct(model, sweep, labels), angles)
    assert reference["per_angle"] == expected["per_angle"] and reference["mean"] == pytest.approx(expected["mean"])
    assert reference["per_angle"][0] == reference["per_angle"][2]  # SC: exactly invariant to a quarter turn
    for name in ("float", "half-pixel"):
        row = result["variants"][name]
        assert row["paired"]["mean"] == pytest.approx(row["mean"] - reference["mean"])
        differences = [a - b for a, b in zip(row["per_angle"], reference["per_angle"])]
        assert row["paired"]["per_angle"] == pytest.approx(differences, abs=1e-3)
    assert result["variants"]["float"]["paired"]["per_angle"][0] == 0  # upright digits are the same images
    assert "| half-pixel |" in capsys.readouterr().out


def test_a_missing_checkpoint_is_one_error_line(tp, tmp_path, capsys):
    from timm_sortconv.cli import run
    with pytest.raises(SystemExit) as exit_info:
        run(tp.main, ["--data-dir", str(tmp_path), "--checkpoint", str(tmp_path / "none.pth.tar")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: --checkpoint {tmp_path / 'none.pth.tar'}: no such file " \
                                              "(a checkpoint written by scripts/train.py)"
