"""The local-rotation benchmark ``scripts/research/local_rotation.py``: its scenes (digits apart, each turned about
its own centre), labels, ceiling and angle grid as properties, and one tiny row end to end on MNIST-layout
data written by the test (random pixels: the numbers mean nothing, the bookkeeping is what is checked)."""

import pytest
import torch
from test_data import make_mnist


@pytest.fixture(scope="module")
def lr():
    import local_rotation
    return local_rotation


def digits_of(count, seed=0):
    """``count`` random 28x28 uint8 images with labels 0..9 in turn."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 28, 28), dtype=torch.uint8, generator=generator), torch.arange(count) % 10


def alone(lr, scenes, i, j, angles=None):
    """Scene ``i`` with only its digit ``j`` (turned by ``angles`` if given), rendered."""
    single = lr.Scenes(scenes.digits[i:i + 1, j:j + 1], scenes.classes[i:i + 1, j:j + 1],
                       scenes.corners[i:i + 1, j:j + 1], scenes.canvas)
    return lr.render(single, angles)[0]


@pytest.mark.parametrize("n, canvas", [(2, 56), (3, 64)])
def test_digits_lie_apart_and_a_scene_is_its_digits(lr, n, canvas):
    images, classes = digits_of(30)
    scenes = lr.make_scenes(images, classes, n, 40, canvas, seed=3)
    centres = scenes.corners.double() + 13.5
    gaps = (centres[:, :, None] - centres[:, None, :]).norm(dim=-1) + 1e9 * torch.eye(n)
    assert gaps.min() >= 2 * lr.RADIUS
    angles = torch.rand(40, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 360
    for turn in (None, angles):
        scene = lr.render(scenes, turn)
        for i in range(40):
            parts = torch.stack([alone(lr, scenes, i, j, None if turn is None else turn[i:i + 1, j:j + 1])
                                 for j in range(n)])
            assert ((parts > 0).sum(0) <= 1).all()  # no pixel holds two digits
            assert torch.equal(scene[i], parts.sum(0, dtype=torch.uint8))


def test_a_digit_turns_about_its_own_centre(lr):
    images, classes = digits_of(10)
    scenes = lr.make_scenes(images, classes, 2, 12, 56, seed=0)
    turned = lr.render(scenes, torch.tensor([[90.0, 0.0]]).expand(12, 2))
    for i in range(12):
        moved = lr.Scenes(torch.stack([torch.rot90(scenes.digits[i, 0], 1), scenes.digits[i, 1]])[None],
                          scenes.classes[i:i + 1], scenes.corners[i:i + 1], 56)
        assert torch.equal(turned[i], lr.render(moved)[0])
    # any angle: the turned digit is the same wherever it lies (the turn is about the digit's centre)
    (r0, c0), (r1, c1) = scenes.corners[0, 0].tolist(), scenes.corners[1, 0].tolist()
    angle = torch.tensor([[37.0]], dtype=torch.float64)
    crop = lambda i, r, c: alone(lr, scenes, i, 0, angle)[r:r + 28, c:c + 28]  # noqa: E731
    shifted = lr.Scenes(scenes.digits[:1, :1], scenes.classes[:1, :1], scenes.corners[1:2, :1], 56)
    assert torch.equal(crop(0, r0, c0), lr.render(shifted, angle)[0][r1:r1 + 28, c1:c1 + 28])
    assert crop(0, r0, c0).sum() > 0


def test_scenes_come_from_the_seed_and_masks_keep_the_disc(lr):
    images, classes = digits_of(30)
    a, b = (lr.make_scenes(images, classes, 2, 20, 56, seed=7) for _ in range(2))
    c = lr.make_scenes(images, classes, 2, 20, 56, seed=8)
    assert all(torch.equal(x, y) for x, y in ((a.digits, b.digits), (a.corners, b.corners), (a.classes, b.classes)))
    assert not torch.equal(a.corners, c.corners)
    assert (a.digits[..., ~lr.disc_mask()] == 0).all() and (a.digits[..., lr.disc_mask()] > 0).any()


def test_labels_are_the_digit_or_the_sum(lr):
    images, classes = digits_of(30)
    one = lr.make_scenes(images, classes, 1, 25, 56, seed=0)
    pair = lr.make_scenes(images, classes, 2, 25, 56, seed=0)
    assert torch.equal(one.labels, one.classes[:, 0])
    assert torch.equal(pair.labels, pair.classes[:, 0] + pair.classes[:, 1])
    assert pair.labels.max() <= 18


def test_ceiling_merges_six_and_nine(lr):
    scenes = lr.Scenes(torch.zeros(4, 2, 28, 28, dtype=torch.uint8), torch.tensor([[6, 1], [1, 9], [9, 1], [2, 3]]),
                       torch.zeros(4, 2, 2, dtype=torch.long), 56)
    # {1, 6=9} holds sums 7, 10, 10: at best 2 of 3 right; {2, 3}: 1 of 1
    assert lr.ceiling(scenes) == pytest.approx(100 * 3 / 4)
    one = lr.Scenes(torch.zeros(5, 1, 28, 28, dtype=torch.uint8), torch.tensor([[6], [9], [9], [6], [0]]),
                    torch.zeros(5, 1, 2, dtype=torch.long), 56)
    assert lr.ceiling(one) == pytest.approx(100 * 3 / 5)


def test_the_grid_turns_every_digit_through_every_angle_independently(lr):
    images, classes = digits_of(10)
    scenes = lr.make_scenes(images, classes, 2, 300, 56, seed=0)
    grid = lr.grid_angles(scenes, 30.0, seed=1)
    assert grid.shape == (12, 300, 2)
    assert (grid[:, :, 0] == torch.arange(12)[:, None] * 30.0).all()
    assert (grid.sort(0).values == torch.arange(12)[:, None, None] * 30.0).all()  # each angle once per digit
    assert len(set((grid[0, :, 1]).tolist())) == 12  # the second digit's angle varies between scenes


def test_a_row_trains_evaluates_records_and_tabulates(lr, tmp_path, capsys, monkeypatch):
    data = tmp_path / "mnist"
    make_mnist(data, num_train=60, num_test=20)
    monkeypatch.setattr(lr, "PROBE_STEPS", 2)
    results = tmp_path / "res" / "local_rotation.csv"
    common = ["--task", "pair", "--data-dir", str(data), "--results", str(results), "--train-scenes", "20",
              "--test-scenes", "8", "--batch-size", "10", "--angle-step", "90", "--model-kwargs",
              "channels=(4,4,4,4,4,4)"]
    lr.main(["--name", "sc", "--model", "scnn_p_rs_3", "--epochs", "1", "--seeds", "0", "1", *common])
    lr.main(["--name", "plain", "--model", "scnn_baseline_3", "--time-budget", "0.5", "--seeds", "0", *common])
    for name, seed in (("sc", 0), ("sc", 1), ("plain", 0)):
        row = lr.records(results).find(task="pair", name=name, seed=seed)
        assert (row["classes"], row["train_scenes"], row["scenes"], row["grid_angles"]) == (19, 20, 8, [0, 90, 180, 270])
        assert row["mean"] == pytest.approx(sum(row["per_angle"]) / 4)
        assert row["worst"] == min(row["per_angle"])
        assert 0 <= row["ceiling"] <= 100 and row["command"].startswith("python scripts/research/local_rotation.py")
    assert row["updates"] >= 2 and row["time_budget"] == 0.5
    lr.main(["--name", "sc", "--model", "scnn_p_rs_3", "--epochs", "1", "--seeds", "0", *common])
    assert f"pair/sc seed 0 is in {results}: skipped" in capsys.readouterr().out
    assert len(lr.records(results).records()) == 3
    lr.main(["--table", "--results", str(results), "--paired", "plain"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("| pair |") for line in lines[2:])
