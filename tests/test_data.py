"""The data sets read their original layouts exactly, split as the paper does, and fail clearly.

Every fixture is written here, in ``tmp_path``, in the exact on-disk layout of the real data set:
IDX files (gzipped and not) for MNIST, the Outex test-suite folder with Sun raster images and its
list files, and NWPU-RESISC45's class folders.
"""
import gzip
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from timm_sortconv.data import (
    MNIST,
    NWPU45,
    OUTEX_ANGLES,
    DatasetLayoutError,
    OutexTC12,
    ResumableSampler,
    RotatedDataset,
    cap_samples,
    create_dataset,
    create_train_loader,
    parse_rotations,
    read_idx,
    resolve_data_config,
)

MNIST_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array: magic (0, 0, 0x08, ndim), big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path, array, gz):
    data = idx_bytes(array)
    if gz:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def make_mnist(folder, num_train=60, num_test=20, gz=True, seed=0):
    """Random 28x28 digits with labels 0..9 in ``folder``; returns the arrays written."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for part, count in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        write_idx(folder / MNIST_NAMES[part][0], images, gz)
        write_idx(folder / MNIST_NAMES[part][1], labels, gz)
        arrays[part] = (images, labels)
    return arrays


def write_sun_raster(path, pixels: np.ndarray):
    """An 8-bit grayscale Sun raster file (the format of Outex's .ras images)."""
    height, width = pixels.shape
    rows = b"".join(row.tobytes() + b"\0" * (width % 2) for row in pixels.astype(np.uint8))
    header = struct.pack(">8I", 0x59A66A95, width, height, 8, len(rows), 1, 0, 0)
    path.write_bytes(header + rows)


def write_list(path, entries):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{len(entries)}\n" + "".join(f"{name} {label}\n" for name, label in entries))


def make_outex(root, num_classes=3, samples=2, angle_major=True):
    """An Outex_TC_00012-style suite; each image's first pixel encodes (illuminant, class, angle, sample)."""
    (root / "images").mkdir(parents=True)
    number = 0
    truth = {}

    def add(illuminant, label, angle, sample):
        nonlocal number
        name = f"{number:06d}.ras"
        code = len(truth)
        pixels = np.full((16, 16), 128, dtype=np.uint8)
        pixels[0, 0], pixels[0, 1] = code % 256, code // 256
        write_sun_raster(root / "images" / name, pixels)
        truth[code] = (illuminant, label, angle, sample)
        number += 1
        return name, label

    train = [add("inca", c, 0, s) for c in range(num_classes) for s in range(samples)]
    tests = {}
    for illuminant in ("t184", "horizon"):
        entries = []
        for c in range(num_classes):
            if angle_major:
                entries += [add(illuminant, c, a, s) for a in OUTEX_ANGLES for s in range(samples)]
            else:
                entries += [add(illuminant, c, a, s) for s in range(samples) for a in OUTEX_ANGLES]
        tests[illuminant] = entries
    classes = [(f"texture{c:02d}", c) for c in range(num_classes)]
    for problem, illuminant in (("000", "t184"), ("001", "horizon")):
        write_list(root / problem / "train.txt", train)
        write_list(root / problem / "test.txt", tests[illuminant])
        write_list(root / problem / "classes.txt", classes)
    return truth


def decode(image) -> int:
    pixels = np.asarray(image)
    return int(pixels[0, 0]) + 256 * int(pixels[0, 1])


def make_nwpu(root, num_classes=3, per_class=7, size=20):
    """Class folders of PNG images whose first pixel encodes (class, image number)."""
    for c in range(num_classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((size, size, 3), 60, dtype=np.uint8)
            pixels[..., 0], pixels[..., 1] = c, i
            Image.fromarray(pixels).save(folder / f"class_{c}_{i + 1:03d}.png")


# ---------------------------------------------------------------- MNIST


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_returns_the_written_array(tmp_path, gz):
    array = np.random.default_rng(1).integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    write_idx(tmp_path / "a-idx3-ubyte", array, gz)
    read = read_idx(tmp_path / ("a-idx3-ubyte.gz" if gz else "a-idx3-ubyte"))
    assert read.shape == (5, 7, 3)
    np.testing.assert_array_equal(read, array)


@pytest.mark.parametrize("layout,gz", [("flat", True), ("flat", False), ("torchvision", True), ("torchvision", False)])
def test_mnist_reads_values_and_labels_from_each_layout(tmp_path, layout, gz):
    folder = tmp_path if layout == "flat" else tmp_path / "MNIST" / "raw"
    arrays = make_mnist(folder, gz=gz)
    test = MNIST(tmp_path, "test")
    images, labels = arrays["test"]
    assert len(test) == len(images)
    for i in (0, 7, len(test) - 1):
        image, label = test[i]
        assert image.mode == "L" and image.size == (28, 28)
        np.testing.assert_array_equal(np.asarray(image), images[i])
        assert label == labels[i]


def test_mnist_split_is_seeded_disjoint_and_covers_the_training_set(tmp_path):
    images, labels = make_mnist(tmp_path, num_train=60)["train"]
    train = MNIST(tmp_path, "train", validation_size=12)
    validation = MNIST(tmp_path, "validation", validation_size=12)
    trainval = MNIST(tmp_path, "trainval")
    assert (len(train), len(validation), len(trainval)) == (48, 12, 60)

    def rows(ds):
        return {ds.images[i].numpy().tobytes() for i in range(len(ds))}

    assert rows(train).isdisjoint(rows(validation))
    assert rows(train) | rows(validation) == {im.tobytes() for im in images}
    # The same seed gives the same split in every run; another seed another split.
    assert torch.equal(MNIST(tmp_path, "validation", validation_size=12).images, validation.images)
    assert not torch.equal(MNIST(tmp_path, "validation", validation_size=12, split_seed=1).images, validation.images)
    # Labels stay with their images.
    by_image = {im.tobytes(): int(lab) for im, lab in zip(images, labels)}
    assert all(by_image[validation.images[i].numpy().tobytes()] == validation[i][1] for i in range(len(validation)))


def test_mnist_missing_folder_names_path_and_layout(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetLayoutError) as info:
        MNIST(missing, "train")
    assert str(missing) in str(info.value) and "t10k-images-idx3-ubyte" in str(info.value)


def test_mnist_missing_files_are_listed(tmp_path):
    make_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetLayoutError, match="missing: t10k-labels-idx1-ubyte"):
        MNIST(tmp_path, "test")


def test_mnist_malformed_idx_files_are_reported(tmp_path):
    make_mnist(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(b"\x00\x00\x0d\x03" + good[4:])
    with pytest.raises(DatasetLayoutError, match="bad magic number") as info:
        MNIST(tmp_path, "train", validation_size=10)
    assert str(images) in str(info.value)
    images.write_bytes(good[:-5])
    with pytest.raises(DatasetLayoutError, match="truncated"):
        MNIST(tmp_path, "train", validation_size=10)
    with pytest.raises(ValueError, match="accepted: train, validation, trainval, test"):
        MNIST(tmp_path, "val")


# ---------------------------------------------------------------- MNIST-rot


def test_mnist_rot_has_every_image_at_every_angle(tmp_path):
    images, labels = make_mnist(tmp_path, num_test=20)["test"]
    mnist_rot = create_dataset("sortconv/mnist_rot", str(tmp_path), "test")
    assert len(mnist_rot) == 36 * 20 and mnist_rot.angles == [float(a) for a in range(0, 360, 10)]
    assert mnist_rot.angle_of(0) == 0 and mnist_rot.angle_of(20) == 10 and mnist_rot.angle_of(36 * 20 - 1) == 350
    assert torch.equal(mnist_rot.item_angles[::20], torch.arange(0, 360, 10, dtype=torch.float64))
    # Item i is test image i % N: the label follows the image at every angle.
    assert [mnist_rot[k * 20 + 3][1] for k in range(36)] == [int(labels[3])] * 36
    # Angle 0 is the image itself.
    np.testing.assert_array_equal(np.asarray(mnist_rot[5][0]), images[5])


def test_mnist_rot_at_quarter_turns_equals_rot90(tmp_path):
    make_mnist(tmp_path, num_test=4)
    base = MNIST(tmp_path, "test")
    rotated = RotatedDataset(base, [90, 180, 270])
    for k, angle in ((1, 90), (2, 180), (3, 270)):
        for i in range(len(base)):
            expected = torch.rot90(base.images[i], k=k, dims=(0, 1))
            got = torch.from_numpy(np.asarray(rotated[(k - 1) * len(base) + i][0]).copy())
            assert torch.equal(got, expected), f"angle {angle}, image {i}"
    # The bilinear path just off the quarter turn is continuous with it: 0.1 degrees away the images
    # differ by a small fraction of what 10 degrees away makes (random pixels: a worst case).
    def mean_difference(angle):
        other = RotatedDataset(base, [angle])
        return max(np.abs(np.asarray(other[i][0], dtype=float) - np.asarray(rotated[i][0], dtype=float)).mean()
                   for i in range(len(base)))

    assert mean_difference(89.9) < 0.05 * mean_difference(80.0)


def test_rotation_is_deterministic_and_stays_on_the_images_grid(tmp_path):
    make_mnist(tmp_path, num_test=3)
    rotated = RotatedDataset(MNIST(tmp_path, "test"), [30])
    first = np.asarray(rotated[1][0])
    assert first.dtype == np.uint8 and first.shape == (28, 28)
    np.testing.assert_array_equal(first, np.asarray(rotated[1][0]))
    assert not np.array_equal(first, np.asarray(rotated.base[1][0]))


def test_rotated_dataset_selects_angles_and_applies_its_transform_after_rotating(tmp_path):
    make_mnist(tmp_path, num_test=5)
    rotated = RotatedDataset(MNIST(tmp_path, "test"), parse_rotations("0:360:90"))
    quarter = rotated.with_angles([90])
    assert len(quarter) == 5 and quarter.angles == [90.0]
    np.testing.assert_array_equal(np.asarray(quarter[2][0]), np.asarray(rotated[5 + 2][0]))
    quarter.transform = lambda image: np.asarray(image)[0, 0]
    assert quarter[2][0] == np.asarray(rotated[7][0])[0, 0]
    base = MNIST(tmp_path, "test", transform=lambda image: image)
    with pytest.raises(ValueError, match="transform unset"):
        RotatedDataset(base)


def test_round_trip_rotates_there_and_back(tmp_path):
    make_mnist(tmp_path, num_test=4)
    base = MNIST(tmp_path, "test")
    there_and_back = RotatedDataset(base, [0, 90], round_trip=True)
    assert there_and_back.with_angles([40]).round_trip and "there and back" in repr(there_and_back)
    for i in range(len(base)):  # quarter turns are exact both ways, and angle 0 is the image itself
        np.testing.assert_array_equal(np.asarray(there_and_back[i][0]), np.asarray(base[i][0]))
        np.testing.assert_array_equal(np.asarray(there_and_back[4 + i][0]), np.asarray(base[i][0]))
    # A smooth off-centre blob 40 degrees there and back: upright again (far closer to the original than the
    # rotated image is), but resampled, so not identical.
    yy, xx = np.mgrid[0:28, 0:28]
    blob = 255 * np.exp(-((yy - 9.0) ** 2 + (xx - 17.0) ** 2) / 12.0)
    smooth = [(Image.fromarray(blob.round().astype(np.uint8)), 0)]
    original = np.asarray(smooth[0][0], dtype=float)
    trip = np.asarray(RotatedDataset(smooth, [40], round_trip=True)[0][0], dtype=float)
    rotated = np.asarray(RotatedDataset(smooth, [40])[0][0], dtype=float)
    assert 0 < np.abs(trip - original).mean() < 0.2 * np.abs(rotated - original).mean()


def test_parse_rotations():
    assert parse_rotations("0:360:10") == [float(a) for a in range(0, 360, 10)]
    assert parse_rotations("0,45,90") == [0.0, 45.0, 90.0]
    assert parse_rotations("15") == [15.0]
    for bad in ("0:360", "a,b", "", "10:0:5", "0:360:0"):
        with pytest.raises(ValueError, match="START:STOP:STEP"):
            parse_rotations(bad)


# ---------------------------------------------------------------- Outex_TC_00012


def test_outex_protocol_sizes_illuminants_and_angles(tmp_path):
    truth = make_outex(tmp_path, num_classes=3, samples=2)
    sizes = {split: len(OutexTC12(tmp_path, split)) for split in ("train", "train:inca+t184", "train:inca", "test")}
    # The paper's 1440 / 960 / 480 / 7680 at 24 classes x 20 samples, here 3 classes x 2 samples.
    assert sizes == {"train": 18, "train:inca+t184": 12, "train:inca": 6, "test": 3 * 2 * 8 * 2}
    for split in ("train", "test"):
        ds = OutexTC12(tmp_path, split)
        for i in range(len(ds)):
            image, label = ds[i]
            assert image.mode == "L" and image.size == (16, 16)
            illuminant, true_label, angle, _ = truth[decode(image)]
            assert (label, ds.illuminants[i], ds.angles[i]) == (true_label, illuminant, angle)
            assert (angle == 0) == (split == "train")
    assert set(OutexTC12(tmp_path, "test").illuminants) == {"t184", "horizon"}
    assert OutexTC12(tmp_path, "train").classes == ["texture00", "texture01", "texture02"]
    assert OutexTC12(tmp_path, "train:inca+tl84").illuminants == OutexTC12(tmp_path, "train:inca+t184").illuminants


def test_outex_sample_major_lists(tmp_path):
    truth = make_outex(tmp_path, angle_major=False)
    ds = OutexTC12(tmp_path, "test", angle_layout="sample-major")
    assert all(truth[decode(ds[i][0])][2] == ds.angles[i] for i in range(len(ds)))


def test_outex_errors_name_the_file_and_layout(tmp_path):
    with pytest.raises(DatasetLayoutError, match="no images/ folder") as info:
        OutexTC12(tmp_path / "missing", "train")
    assert "000/train.txt" in str(info.value)
    make_outex(tmp_path)
    listing = tmp_path / "001" / "test.txt"
    lines = listing.read_text().splitlines()
    listing.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(DatasetLayoutError, match="declares") as info:
        OutexTC12(tmp_path, "test")
    assert str(listing) in str(info.value)
    listing.write_text(f"{len(lines) - 2}\n" + "\n".join(lines[1:-1]) + "\n")
    with pytest.raises(DatasetLayoutError, match="not a multiple of the 9 angles"):
        OutexTC12(tmp_path, "test")
    with pytest.raises(ValueError, match="illuminants"):
        OutexTC12(tmp_path, "train:inca+sunlight")
    with pytest.raises(ValueError, match="accepted"):
        OutexTC12(tmp_path, "validation")


# ---------------------------------------------------------------- NWPU-RESISC45


def test_nwpu_seeded_per_class_split(tmp_path):
    make_nwpu(tmp_path / "NWPU-RESISC45", num_classes=3, per_class=7)
    train = NWPU45(tmp_path, "train", train_pool=4, image_size=8)
    small = NWPU45(tmp_path, "train:2", train_pool=4, image_size=8)
    test = NWPU45(tmp_path, "test", train_pool=4, image_size=8)
    assert (len(train), len(small), len(test)) == (12, 6, 9)
    for ds, per_class in ((train, 4), (small, 2), (test, 3)):
        assert np.bincount(ds.targets).tolist() == [per_class] * 3
    paths = {split: {p for p, _ in ds.samples} for split, ds in (("train", train), ("small", small), ("test", test))}
    assert paths["train"].isdisjoint(paths["test"]) and paths["small"] <= paths["train"]
    assert len(paths["train"] | paths["test"]) == 21
    assert NWPU45(tmp_path, "test", train_pool=4).samples == test.samples
    assert NWPU45(tmp_path, "test", train_pool=4, split_seed=3).samples != test.samples
    image, label = train[5]
    assert image.mode == "RGB" and image.size == (8, 8)
    assert np.asarray(image)[0, 0, 0] == label == train.classes.index(train.samples[5][0].parent.name)


def test_nwpu_errors(tmp_path):
    with pytest.raises(DatasetLayoutError, match="does not exist"):
        NWPU45(tmp_path / "missing")
    make_nwpu(tmp_path, num_classes=2, per_class=3)
    with pytest.raises(DatasetLayoutError, match="needs more than train_pool=400") as info:
        NWPU45(tmp_path, "train")
    assert "class_0" in str(info.value)
    with pytest.raises(ValueError, match="N must be a whole number"):
        NWPU45(tmp_path, "train:5", train_pool=2)


# ---------------------------------------------------------------- create_dataset, loaders, config


def test_create_dataset_names_and_timm_passthrough(tmp_path):
    make_mnist(tmp_path / "mnist", num_test=10)
    assert len(create_dataset("sortconv/mnist", str(tmp_path / "mnist"), "test")) == 10
    make_nwpu(tmp_path / "folder", num_classes=2, per_class=3)
    timm_folder = create_dataset("", str(tmp_path / "folder"), "train")  # timm's ImageDataset
    assert len(timm_folder) == 6 and sorted({t for _, t in timm_folder}) == [0, 1]
    with pytest.raises(ValueError, match="unknown data set 'sortconv/cifar'"):
        create_dataset("sortconv/cifar", str(tmp_path), "train")
    with pytest.raises(DatasetLayoutError, match="image folder does not exist") as info:
        create_dataset("", str(tmp_path / "absent"), "train")
    assert str(tmp_path / "absent") in str(info.value)


def test_cap_samples_is_a_seeded_slice_that_forwards_transform(tmp_path):
    make_mnist(tmp_path, num_test=20)
    ds = MNIST(tmp_path, "test")
    capped = cap_samples(ds, 8, seed=5)
    assert len(capped) == 8 and capped.indices == cap_samples(ds, 8, seed=5).indices
    assert capped.indices == sorted(capped.indices) and capped.indices != cap_samples(ds, 8, seed=6).indices
    assert cap_samples(ds, 100) is ds
    capped.transform = np.asarray
    assert ds.transform is np.asarray
    np.testing.assert_array_equal(capped[3][0], ds.images[capped.indices[3]].numpy())


def test_resumable_sampler_shards_and_resumes():
    full = list(ResumableSampler(10, seed=3))
    assert sorted(full) == list(range(10))
    later = ResumableSampler(10, seed=3)
    later.set_epoch(0, start=4)
    assert list(later) == full[4:] and len(later) == 6
    other_epoch = ResumableSampler(10, seed=3)
    other_epoch.set_epoch(1)
    assert list(other_epoch) != full
    shards = [list(ResumableSampler(10, seed=3, num_replicas=3, rank=r)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]
    assert set().union(*shards) == set(range(10))


@pytest.mark.parametrize("use_prefetcher", [True, False])
def test_grayscale_loaders_normalise_one_channel_without_resizing(tmp_path, use_prefetcher):
    make_mnist(tmp_path, num_train=40)
    ds = MNIST(tmp_path, "trainval")
    config = resolve_data_config({"mean": (0.1307,), "std": (0.3081,), "input_size": (1, 28, 28)},
                                 dataset="sortconv/mnist")
    assert config["crop_pct"] == 1.0
    loader = create_train_loader(ds, config["input_size"], batch_size=8, seed=0, use_prefetcher=use_prefetcher,
                                 mean=config["mean"], std=config["std"], no_aug=True, interpolation="bilinear")
    loader.sampler.set_epoch(0)
    order = list(loader.sampler)
    images, targets = next(iter(loader))
    assert images.shape == (8, 1, 28, 28) and images.dtype == torch.float32
    expected = (ds.images[order[:8]].float().unsqueeze(1) / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-5)
    assert targets.tolist() == ds.targets[order[:8]].tolist()


def test_data_config_fits_a_model_built_with_other_channels():
    import timm

    model = timm.create_model("resnet18", in_chans=1, num_classes=10)
    config = resolve_data_config({"in_chans": 1}, model=model)
    assert config["input_size"] == (1, 224, 224) and len(config["mean"]) == len(config["std"]) == 1
    assert config["crop_pct"] == model.pretrained_cfg["crop_pct"]


def test_export_writes_the_protocol_as_image_folders_timm_reads(tmp_path):
    from timm_sortconv.data.export import main as export

    make_outex(tmp_path / "outex", num_classes=3, samples=2)
    export(["sortconv/outex12", "--data-dir", str(tmp_path / "outex"), "--out", str(tmp_path / "folders"),
            "--train-split", "train:inca+t184"])
    ours = {"train": OutexTC12(tmp_path / "outex", "train:inca+t184"),
            "validation": OutexTC12(tmp_path / "outex", "test")}
    for split, dataset in ours.items():
        folder = create_dataset("", str(tmp_path / "folders"), split, input_img_mode="L")  # timm's image folder
        names = {index: name for name, index in folder.reader.class_to_idx.items()}
        assert len(folder) == len(dataset)
        written = {decode(image): names[label] for image, label in folder}
        assert written == {decode(image): dataset.classes[label] for image, label in dataset}
