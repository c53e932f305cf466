"""rotate and rotation_sweep: the rotation convention, exactness, determinism, and sane sweep numbers."""
import math

import pytest
import timm
import torch
import torchvision

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv.cli import run
from timm_sortconv.cli.invariance import main
from timm_sortconv.data import synthetic_digits
from timm_sortconv.invariance import RotationSweep, rotation_sweep, sweep_table
from timm_sortconv.rotation import rotate


def _smooth_image(size=33, dtype=torch.float64):
    coords = torch.arange(size, dtype=dtype) - (size - 1) / 2
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    return (torch.exp(-((xx - 4) ** 2 + (yy + 2) ** 2) / 20) + 0.5 * torch.exp(-((xx + 5) ** 2 + yy ** 2) / 12)).view(
        1, 1, size, size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("angle, quarters", [(0, 0), (90, 1), (180.0, 2), (270, 3), (-90, 3), (450, 1), (360, 0)])
def test_multiples_of_90_degrees_are_exact_rot90(dtype, angle, quarters):
    x = (torch.rand(2, 3, 7, 7) * 200).to(dtype)
    out = rotate(x, angle)
    assert out.dtype == dtype and torch.equal(out, torch.rot90(x, quarters, dims=(-2, -1)))
    assert out.data_ptr() != x.data_ptr()


def test_bilinear_path_turns_counter_clockwise_like_rot90():
    x = torch.rand(2, 1, 9, 9, dtype=torch.float64)
    # Just off the quarter turn the interpolating path runs; it must land next to torch.rot90's result.
    assert torch.allclose(rotate(x, 90 + 1e-7), torch.rot90(x, 1, dims=(-2, -1)), atol=1e-7)
    assert torch.allclose(rotate(x, -90 + 1e-7), torch.rot90(x, -1, dims=(-2, -1)), atol=1e-7)
    # A blob right of the centre moves up (row index decreases) for a positive angle.
    size = 41
    centre = (size - 1) / 2
    coords = torch.arange(size, dtype=torch.float64)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    blob = torch.exp(-((xx - centre - 10) ** 2 + (yy - centre) ** 2) / 4).view(1, 1, size, size)
    out = rotate(blob, 30)[0, 0]
    mass = out.sum()
    assert (out * xx).sum() / mass == pytest.approx(centre + 10 * math.cos(math.radians(30)), abs=0.05)
    assert (out * yy).sum() / mass == pytest.approx(centre - 10 * math.sin(math.radians(30)), abs=0.05)


def test_rotating_back_restores_a_smooth_image():
    x = _smooth_image()
    back = rotate(rotate(x, 37), -37)
    # two bilinear resamplings blur a little; a wrong centre or direction would be off by ~1
    assert (back - x).abs().max() < 0.05
    assert (rotate(x, 37) - x).abs().max() > 0.3
    assert (rotate(rotate(x, 37), 37) - rotate(x, 74)).abs().max() < 0.05


def test_deterministic_batch_independent_and_shape_preserving():
    x = torch.rand(5, 3, 12, 17)
    out = rotate(x, 23.5)
    assert out.shape == x.shape and torch.equal(out, rotate(x, 23.5))
    for i in range(5):
        assert torch.equal(out[i:i + 1], rotate(x[i:i + 1], 23.5))
        assert torch.equal(out[i], rotate(x[i], 23.5))
    assert rotate(x, 90).shape == x.shape  # a non-square image keeps its size (interpolated, corners filled)
    assert torch.equal(rotate(x, 180), torch.rot90(x, 2, dims=(-2, -1)))


def test_fill_and_dtypes():
    x = torch.full((1, 1, 10, 10), 0.25)
    assert torch.allclose(rotate(x, 33, fill=0.25), x)
    rotated = rotate(x, 33)
    assert rotated[0, 0, 0, 0] == 0 and rotated[0, 0, 5, 5] == pytest.approx(0.25)
    assert rotate(x.bfloat16(), 33).dtype == torch.bfloat16


@pytest.mark.parametrize("images, angle, error", [
    (torch.zeros(5), 30, ValueError),
    (torch.zeros(1, 4, 4, dtype=torch.uint8), 30, TypeError),
    (torch.zeros(1, 4, 4), float("nan"), ValueError),
    (torch.zeros(1, 1, 4), 30, ValueError),
])
def test_rotate_rejects_bad_input(images, angle, error):
    with pytest.raises(error):
        rotate(images, angle)


def test_sweep_separates_sorting_from_plain_convolutions():
    images = synthetic_digits(4, dtype=torch.float64)
    angles = [0, 45, 90, 180, 270]
    sweeps = {}
    for name in ("scnn_p_rs_3", "scnn_baseline_3"):
        torch.manual_seed(0)
        sweeps[name] = rotation_sweep(timm.create_model(name).double(), images, angles)
    sc, plain = sweeps["scnn_p_rs_3"], sweeps["scnn_baseline_3"]
    assert sc.angles == [0.0, 45.0, 90.0, 180.0, 270.0]
    assert sc.feature_change[0] == 0 and sc.agreement[0] == 1
    assert max(sc.feature_change[2:]) < 1e-12 and sc.agreement[2:] == [1.0, 1.0, 1.0]
    assert min(plain.feature_change[2:]) > 1e-2
    assert 0 < sc.feature_change[1] < 0.5
    table = sweep_table(sweeps)
    assert table.splitlines()[0].startswith("| angle | scnn_p_rs_3: feature change")
    assert "| 45 |" in table and len(table.splitlines()) == 2 + len(angles)


def test_sweep_numbers_match_a_direct_computation():
    torch.manual_seed(0)
    model = timm.create_model("scnn_baseline_3", num_classes=3).train()
    images = synthetic_digits(6, seed=1)
    targets = torch.tensor([0, 1, 2, 0, 1, 2])
    sweep = rotation_sweep(model, images, [30, 200], targets=targets, batch_size=4)
    assert model.training  # restored
    model.eval()
    with torch.no_grad():
        def pooled(x):
            return model.forward_head(model.forward_features(x), pre_logits=True).double()
        reference, reference_pred = pooled(images), model(images).argmax(1)
        for i, angle in enumerate([30, 200]):
            rotated = rotate(images, angle)
            change = ((pooled(rotated) - reference).norm(dim=1) / reference.norm(dim=1)).mean().item()
            pred = model(rotated).argmax(1)
            assert sweep.feature_change[i] == pytest.approx(change, rel=1e-5)
            assert sweep.agreement[i] == (pred == reference_pred).double().mean().item()
            assert sweep.accuracy[i] == (pred == targets).double().mean().item()
    rows = sweep.rows()
    assert [r["angle"] for r in rows] == [30.0, 200.0] and "accuracy" in rows[0]
    assert "accuracy" in str(sweep) and isinstance(sweep, RotationSweep)


def test_sweep_of_a_model_without_timm_api_needs_a_feature_function():
    model = torchvision.models.resnet18(weights=None, num_classes=4)
    images = torch.rand(2, 3, 32, 32)
    with pytest.raises(TypeError, match="features="):
        rotation_sweep(model, images, [0, 90])

    def pooled(x):
        body = torch.nn.Sequential(*list(model.children())[:-1])
        return torch.flatten(body(x), 1)

    sweep = rotation_sweep(model, images, [0, 90], features=pooled)
    assert sweep.feature_change[0] == 0 and sweep.feature_change[1] > 0


@pytest.mark.parametrize("kwargs, error", [
    (dict(images=torch.zeros(1, 28, 28)), ValueError),
    (dict(angles=[]), ValueError),
    (dict(targets=torch.zeros(3, dtype=torch.long)), ValueError),
    (dict(batch_size=0), ValueError),
])
def test_sweep_rejects_bad_input(kwargs, error):
    args = dict(model=timm.create_model("scnn_baseline_3"), images=torch.zeros(2, 1, 28, 28), angles=[0, 90])
    args.update(kwargs)
    with pytest.raises(error):
        rotation_sweep(**args)


def test_sweep_table_needs_matching_angles():
    a = RotationSweep([0.0, 90.0], [0.0, 0.1], [1.0, 1.0])
    b = RotationSweep([0.0, 45.0], [0.0, 0.1], [1.0, 0.5])
    with pytest.raises(ValueError, match="angles"):
        sweep_table({"a": a, "b": b})


def test_synthetic_digits_are_seeded_strokes():
    x = synthetic_digits(3, seed=5)
    assert x.shape == (3, 1, 28, 28) and torch.equal(x, synthetic_digits(3, seed=5))
    assert not torch.equal(x, synthetic_digits(3, seed=6))
    assert x.min() >= 0 and x.max() <= 1 and (x.amax(dim=(1, 2, 3)) > 0.7).all()
    # ink stays inside the MNIST-like central box, the border is background
    assert x[..., 0, :].max() < 1e-3 and x[..., :, -1].max() < 1e-3


def test_command_line(capsys):
    main(["--models", "scnn_p_rs_3", "scnn_baseline_3", "--angles", "0,90", "--num-images", "2"])
    out = capsys.readouterr().out
    assert "| 90 | 0.00% | 100.0% |" in out and "scnn_baseline_3: feature change" in out


def test_command_line_quarter_turn_table(capsys):
    """``--quarter-turn``: the paper's grid is exact at 28 and not at 29, the centred one at both; the nearest
    exact size found for 29 is 28; --sortify converts a plain model first."""
    main(["--models", "scnn_p_rs_3", "--quarter-turn", "28", "29", "--stride-align", "corner", "--search", "1"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[2], float(r[3]) < 1e-10, r[4].rstrip(" |")) for r in rows] == [("28", True, "28"), ("29", False, "28")]
    main(["--models", "scnn_p_rs_3", "--quarter-turn", "29"])
    assert float(capsys.readouterr().out.splitlines()[2].split(" | ")[3]) < 1e-10
    main(["--models", "scnn_baseline_3", "--sortify", "--quarter-turn", "29"])
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| sortify(scnn_baseline_3) | centre | 29 |") and float(row.split(" | ")[3]) < 1e-10
    with pytest.raises(SystemExit):
        main(["--quarter-turn", "0"])
    for models, message in ((["resnet18"], "resnet18 is not an SC model; add --sortify"),
                            (["no_such_net"], "error: unknown model 'no_such_net'")):
        with pytest.raises(SystemExit):
            run(main, ["--models", *models, "--quarter-turn", "32"])
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_plot_labels_both_panels_and_its_legends_cover_no_curve():
    """Each panel has a title and a legend naming every curve, drawn outside the panel: no legend can hide
    a point of a curve, however low."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from timm_sortconv.invariance import sweep_figure

    angles = [10.0 * i for i in range(36)]
    results = {"scnn_p_rs_3": {a: 90.0 for a in angles}, "scnn_baseline_3": {a: 2.0 + a / 100 for a in angles}}
    fig = sweep_figure(results, "MNIST", {"scnn_p_rs_3": "Sorting Convolution"})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert len(fig.axes) == 2
    for axes in fig.axes:
        assert axes.get_title()
        legend = axes.get_legend()
        assert legend is not None, axes.get_title()
        names = [text.get_text() for text in legend.get_texts()]
        assert len(names) == 2 and names[0].startswith("scnn_p_rs_3: Sorting Convolution") \
            and names[1].startswith("scnn_baseline_3")
        assert not legend.get_window_extent(renderer).overlaps(axes.get_window_extent(renderer))
    plt.close(fig)
