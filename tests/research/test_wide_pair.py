"""``scripts/research/wide_pair.py`` and the non-square canvas of ``local_rotation.py`` it runs on: scenes on a strip
(digits apart, inside it, each its own), the study's rows and steps, and a tiny run end to end on MNIST-layout data
written by the test (random pixels: the numbers mean nothing, the bookkeeping and the resumption are checked)."""
import pytest
import torch
from test_data import make_mnist
from test_local_rotation import digits_of


@pytest.fixture(scope="module")
def lr():
    import local_rotation
    return local_rotation


@pytest.fixture(scope="module")
def wide():
    import wide_pair
    return wide_pair


@pytest.mark.parametrize("canvas", [(28, 60), (40, 90), (70, 30)])
def test_scenes_on_a_strip_lie_inside_it_apart_and_are_their_digits(lr, canvas):
    images, classes = digits_of(30)
    scenes = lr.make_scenes(images, classes, 2, 60, canvas, seed=3)
    assert scenes.size == canvas
    corners = scenes.corners
    assert (corners >= 0).all() and (corners[..., 0] <= canvas[0] - 28).all() and (corners[..., 1] <= canvas[1] - 28).all()
    assert (corners[:, 0] - corners[:, 1]).double().norm(dim=-1).min() >= 2 * lr.RADIUS
    angles = torch.rand(60, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 360
    rendered = lr.render(scenes, angles)
    assert rendered.shape == (60, *canvas)
    for i in range(60):
        for j in range(2):
            single = lr.Scenes(scenes.digits[i:i + 1, j:j + 1], scenes.classes[i:i + 1, j:j + 1],
                               scenes.corners[i:i + 1, j:j + 1], canvas)
            part = lr.render(single, angles[i:i + 1, j:j + 1])[0]
            (r, c) = scenes.corners[i, j].tolist()
            assert torch.equal(rendered[i, r:r + 28, c:c + 28][lr.disc_mask()], part[r:r + 28, c:c + 28][lr.disc_mask()])
    # a square canvas given as a pair draws the same scenes as given as a side
    square = lr.make_scenes(images, classes, 2, 20, 56, seed=4)
    assert torch.equal(square.corners, lr.make_scenes(images, classes, 2, 20, (56, 56), seed=4).corners)


@pytest.mark.parametrize("text", ["27", "28x20", "28x", "wide", "28x60x2"])
def test_a_bad_canvas_is_refused_with_the_accepted_forms(lr, text, capsys):
    with pytest.raises(SystemExit):
        lr.main(["--name", "x", "--data-dir", "nowhere", "--canvas", text])
    assert "expected a side or HEIGHTxWIDTH, each at least 28 pixels" in capsys.readouterr().err


def test_the_study_is_the_decision_tables_four_rows_at_four_times_its_steps(wide):
    import decision_table

    assert [row.name for row in wide.ROWS] == ["align+guide", "guide+canon+ramp", "p_rs_7_blur", "e2cnn_c8"]
    assert all(row in decision_table.ROWS for row in wide.ROWS) and wide.STEPS == 4 * decision_table.LOCAL_STEPS
    guided_canon = wide.ROWS[1]
    assert wide.network_input(guided_canon, (28, 60)) == (70, 70) and wide.network_input(wide.ROWS[0], (28, 60)) == (28, 60)


def test_a_tiny_study_runs_resumes_and_tabulates(wide, tmp_path, capsys):
    data, out, results = tmp_path / "mnist", tmp_path / "runs", tmp_path / "wide.csv"
    make_mnist(data, num_train=60, num_test=20)
    args = ["run", "--data-dir", str(data), "--output", str(out), "--results", str(results), "--rows", "align+guide",
            "guide+canon+ramp", "--seeds", "0", "--steps", "3", "--train-scenes", "50", "--test-scenes", "6",
            "--channels", *["8"] * 6, "--checkpoint-every", "2"]
    wide.main(args)
    records = {r["row"]: r for r in wide.records(results).records()}
    assert set(records) == {"align+guide", "guide+canon+ramp"}
    first = records["guide+canon+ramp"]
    assert first["input"] == [70, 70] and first["canvas"] == [28, 60] and first["steps"] == 3
    assert first["scenes"] == 6 and first["mean"] == pytest.approx(sum(first["per_angle"]) / 12)
    assert first["machine"]["threads"] == 1 and first["command"].startswith("python scripts/research/wide_pair.py run")
    wide.main(args)
    assert "every job is in" in capsys.readouterr().out
    # the row lost, the trained weights kept: the job measures again without training, to the same numbers
    wide.records(results).path.write_text("")
    wide.main(args)
    assert "resumed at step 3/3" in capsys.readouterr().out
    again = wide.records(results).find(row="guide+canon+ramp", seed=0)
    assert all(again[key] == first[key] for key in ("upright", "mean", "worst", "random", "per_angle"))
    lines = wide.table(results).splitlines()
    assert lines[2].startswith("| align+guide |") and lines[3].startswith("| guide+canon+ramp | ")
    assert "| 70x70 |" in lines[3] and "28x60 canvas" in lines[-1]


def test_bad_input_is_one_error_line(wide, tmp_path, capsys):
    with pytest.raises(SystemExit):
        wide.main(["run", "--data-dir", str(tmp_path)])
    assert "run needs --data-dir (the MNIST folder) and --output" in capsys.readouterr().err
    with pytest.raises(wide.CommandError, match="no results in"):
        wide.main(["table", "--results", str(tmp_path / "none.csv")])
