"""Smoke tests of the image and video examples (examples/image, examples/video).

Tiny settings only: both commands run end to end and write their results and
figures; a run is repeatable bit for bit; the ``--data`` loaders read tiny
fixtures made here (an ImageFolder tree and a UCF-101-style frame tree); the
backbones differ only where they should; and the README's tables equal the
rendering of the committed results.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the vision examples need PyTorch")
pytest.importorskip("matplotlib", reason="the vision examples need matplotlib")
pytest.importorskip("skimage", reason="the image example needs scikit-image")
PIL = pytest.importorskip("PIL.Image", reason="the --data loaders need Pillow")

from examples.image import data as image_data  # noqa: E402
from examples.image.__main__ import main as image_main  # noqa: E402
from examples.image.backbone import Backbone, BackboneConfig, local_mask  # noqa: E402
from examples.image.train import SCALES as IMAGE_SCALES  # noqa: E402
from examples.image.train import patchify, random_masks, train_one, unpatchify  # noqa: E402
from examples.video import data as video_data  # noqa: E402
from examples.video.__main__ import main as video_main  # noqa: E402
from examples.video.train import VideoConfig, tubelets  # noqa: E402

RESULT_KEYS = {"task", "command", "commit", "config", "rows", "seeds", "params", "runs"}


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread, as the CLIs default to; the runs also switch on deterministic algorithms,
    which is put back afterwards so that other tests see what they expect."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _check_rows(result: dict, metrics: set[str]) -> None:
    assert RESULT_KEYS <= result.keys()
    assert {r["metric"] for r in result["rows"]} == metrics
    for row in result["rows"]:
        assert len(row["seeds"]) == len(result["seeds"])
        assert all(math.isfinite(v) for v in row["seeds"])


# --------------------------------------------------------------------------- image


def test_image_tiny_run_writes_results_and_pictures(tmp_path):
    assert image_main(["--tiny", "--out", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "results" / "masked-tiny.json").read_text())
    _check_rows(result, {"psnr", "ssim", "step_ms"})
    assert set(result["params"]) == {"base", "local", "registers", "memory"}
    assert {r["setting"] for r in result["rows"] if r["metric"] == "psnr"} == \
        {"25%", "50%", "75%"}
    for row in result["rows"]:
        if row["metric"] == "ssim":
            assert all(-1.0 <= v <= 1.0 for v in row["seeds"])
        if row["metric"] == "psnr":
            assert all(0.0 < v < 60.0 for v in row["seeds"])
    # more masking, less to copy: PSNR falls with the mask ratio for every model
    for model in result["params"]:
        psnr = [next(r["seeds"][0] for r in result["rows"] if r["model"] == model
                     and r["metric"] == "psnr" and r["setting"] == s)
                for s in ("25%", "50%", "75%")]
        assert psnr[0] > psnr[1] > psnr[2], (model, psnr)
    for name in ("base", "local", "registers", "memory", "metrics"):
        assert (tmp_path / "figures" / f"{name}-masked-tiny.png").stat().st_size > 0
    # the memory row is the only one with memory gates, one per block
    assert result["gates"]["memory"][0] and not result["gates"]["base"][0]


def _tiny_images(n: int, size: int = 16) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.random((n, 3, size, size), dtype=np.float32)


def test_image_same_seed_same_numbers():
    config = IMAGE_SCALES["tiny"]
    train, test = _tiny_images(16), _tiny_images(8)
    a, _ = train_one("memory", 3, config, train, test, progress=False)
    b, _ = train_one("memory", 3, config, train, test, progress=False)
    c, _ = train_one("memory", 4, config, train, test, progress=False)
    for key in ("psnr", "ssim", "loss_curve", "gates"):
        assert a[key] == b[key], key
    assert a["loss_curve"] != c["loss_curve"]


def test_patches_round_trip_and_masks():
    images = torch.rand(2, 3, 16, 16)
    patches = patchify(images, 4)
    assert patches.shape == (2, 16, 48)
    # patch 1 is the second patch of the first row
    assert torch.equal(patches[0, 1].reshape(3, 4, 4), images[0, :, 0:4, 4:8])
    assert torch.equal(unpatchify(patches, 4, 3, 16), images)
    masks = random_masks(5, 16, 0.75, torch.Generator().manual_seed(0))
    assert masks.sum(dim=1).tolist() == [12] * 5


def test_image_folder_loader(tmp_path):
    rng = np.random.default_rng(0)
    for cls, count in (("001.Albatross", 4), ("002.Auklet", 3)):
        folder = tmp_path / cls
        folder.mkdir()
        for i in range(count):
            pixels = rng.integers(0, 256, (20 + 5 * i, 30, 3), dtype=np.uint8)
            PIL.fromarray(pixels).save(folder / f"img_{i}.{'png' if i % 2 else 'jpg'}")
        (folder / "notes.txt").write_text("not an image")
    PIL.fromarray(np.full((10, 12), 200, np.uint8)).save(tmp_path / "001.Albatross" / "g.png")
    train, test = image_data.folder_split(tmp_path, 16, test_every=2)
    # 5 + 3 images; every 2nd file of each class (sorted) is held out: 3 + 2
    assert train.shape == (3, 3, 16, 16) and test.shape == (5, 3, 16, 16)
    assert train.dtype == np.float32 and 0.0 <= train.min() and train.max() <= 1.0
    grey = image_data.load_image(tmp_path / "001.Albatross" / "g.png", 8)
    assert grey.shape == (3, 8, 8) and np.allclose(grey, 200 / 255)
    with pytest.raises(ValueError, match="data"):
        image_data.folder_split(tmp_path / "missing", 16)


def test_image_main_reads_a_folder(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "birds"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            PIL.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(
                root / cls / f"{i}.png")
    out = tmp_path / "out"
    assert image_main(["--tiny", "--data", str(root), "--models", "base", "--out", str(out),
                       "--no-progress"]) == 0
    result = json.loads((out / "results" / "masked-birds-tiny.json").read_text())
    assert result["data"] == "folder birds" and list(result["params"]) == ["base"]


def test_bundled_crops_are_offline_and_held_out():
    train, test = image_data.bundled_split(16, 8, 4, seed=0)
    again, test_again = image_data.bundled_split(16, 8, 4, seed=0)
    other, test_other = image_data.bundled_split(16, 8, 4, seed=1)
    assert train.shape == (8, 3, 16, 16) and test.shape == (4, 3, 16, 16)
    assert np.array_equal(train, again) and not np.array_equal(train, other)
    assert np.array_equal(test, test_other)  # the held-out crops do not depend on the seed
    assert not set(image_data.TRAIN_IMAGES) & set(image_data.TEST_IMAGES)


def test_backbones_differ_only_where_they_should():
    mask = local_mask((4, 4), 1)
    assert mask.shape == (16, 16) and not mask[5, 0] and mask[0, 15] and not mask.diagonal().any()
    config = BackboneConfig(grid=(4, 4), width=16, depth=2, heads=2, memory_channels=2)
    x = torch.randn(2, 16, 16)
    for kind in ("base", "local", "registers", "memory"):
        assert Backbone(kind, config)(x).shape == (2, 16, 16)
    memory = Backbone("memory", config)
    assert memory.handle.mode == "threaded"
    assert memory.handle.memories[0].memory.memory_shape == (4, 4)
    assert memory.handle.memories[0].memory.chunk_size == 4  # one row of patches per chunk
    with pytest.raises(ValueError, match="kind"):
        Backbone("sparse", config)
    with pytest.raises(ValueError, match="x: expected"):
        Backbone("base", config)(torch.randn(2, 15, 16))


def test_full_scale_models_build_and_run():
    """--full is meant for a GPU; here its models are built and run on one example."""
    from examples.image.train import MaskedAutoencoder
    from examples.video.train import SCALES as VIDEO_SCALES
    from examples.video.train import ClipClassifier

    config = IMAGE_SCALES["full"]
    model = MaskedAutoencoder("memory", config).eval()
    patches = patchify(torch.rand(1, 3, config.size, config.size), config.patch)
    with torch.no_grad():
        assert model(patches, torch.zeros(1, 64, dtype=torch.bool)).shape == patches.shape
    video = VIDEO_SCALES["full"]
    clf = ClipClassifier("memory", video, channels=3, classes=101).eval()
    with torch.no_grad():
        assert clf(torch.rand(1, video.frames, 3, video.size, video.size)).shape == (1, 101)


# --------------------------------------------------------------------------- video


def test_video_tiny_run_writes_results(tmp_path):
    assert video_main(["--tiny", "--out", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "results" / "actions-tiny.json").read_text())
    _check_rows(result, {"top1", "top5", "step_ms"})
    assert list(result["params"]) == ["base", "registers", "memory"]
    for row in result["rows"]:
        if row["metric"] in ("top1", "top5"):
            assert all(0.0 <= v <= 100.0 for v in row["seeds"])
    top1 = {r["model"]: r["seeds"] for r in result["rows"] if r["metric"] == "top1"}
    top5 = {r["model"]: r["seeds"] for r in result["rows"] if r["metric"] == "top5"}
    assert all(a <= b for m in top1 for a, b in zip(top1[m], top5[m], strict=True))
    assert result["config"]["grid"] == [2, 4, 4]  # 4 frames in tubelets of 2, 4x4 patches
    for name in ("accuracy", "clips"):
        assert (tmp_path / "figures" / f"{name}-actions-tiny.png").stat().st_size > 0


def test_procedural_clips():
    clips, labels = video_data.procedural(40, 8, 16, seed=5)
    again, labels_again = video_data.procedural(40, 8, 16, seed=5)
    assert clips.shape == (40, 8, 1, 16, 16) and clips.dtype == np.float32
    assert np.array_equal(clips, again) and np.array_equal(labels, labels_again)
    assert np.bincount(labels).tolist() == [4] * len(video_data.CLASSES)
    # occluded frames: the whole view grey, in some clips but not all
    occluded = (np.abs(clips - 0.5) < 0.1).all(axis=(2, 3, 4))
    assert 0 < occluded.any(axis=1).sum() < 40
    assert occluded.sum(axis=1).max() <= 4
    # "right": the brightest column moves right over the visible frames
    rng = np.random.default_rng(0)
    path = video_data._path(0, 8, 16, 2.5, rng)
    assert np.all(np.diff(path[:, 1]) > 0) and np.all(np.diff(path[:, 0]) == 0)
    with pytest.raises(ValueError, match="frames"):
        video_data.procedural(4, 2, 16, 0)


def test_tubelets_are_time_major():
    clips = torch.rand(2, 4, 1, 8, 8)
    tokens = tubelets(clips, 4, tube=2)
    assert tokens.shape == (2, 8, 32)
    # token 4 + 1: second time step (frames 2, 3), first row, second column
    assert torch.equal(tokens[0, 4 + 1].reshape(2, 1, 4, 4), clips[0, 2:4, :, 0:4, 4:8])
    assert torch.equal(tubelets(clips, 4)[0, 4 + 1].reshape(1, 4, 4), clips[0, 1, :, 0:4, 4:8])
    with pytest.raises(ValueError, match="frames"):
        VideoConfig(frames=7, tube=2)


def _write_clip(folder, frames: int, start: int) -> None:
    folder.mkdir(parents=True)
    for f in range(frames):
        value = (start + 10 * f) % 256
        PIL.fromarray(np.full((12, 16, 3), value, np.uint8)).save(
            folder / f"frame_{f + 1:04d}.jpg", quality=100)


def test_ucf_folder_loader(tmp_path):
    # UCF-101 names: groups 1-7 are held out (split 1)
    _write_clip(tmp_path / "ApplyLipstick" / "v_ApplyLipstick_g01_c01", 10, 0)
    _write_clip(tmp_path / "ApplyLipstick" / "v_ApplyLipstick_g08_c01", 10, 100)
    _write_clip(tmp_path / "Archery" / "v_Archery_g02_c03", 5, 50)
    _write_clip(tmp_path / "Archery" / "v_Archery_g09_c01", 5, 150)
    (train_x, train_y), (test_x, test_y), classes = video_data.folder_split(tmp_path, 4, 8)
    assert classes == ["ApplyLipstick", "Archery"]
    assert train_x.shape == (2, 4, 3, 8, 8) and test_x.shape == (2, 4, 3, 8, 8)
    assert train_y.tolist() == [0, 1] and test_y.tolist() == [0, 1]
    # 4 of 10 frames evenly spaced: frames 0, 3, 6, 9 -> values 100 + 10 * index
    means = train_x[0].mean(axis=(1, 2, 3)) * 255
    assert np.allclose(means, [100, 130, 160, 190], atol=2)
    # other names: every test_every-th clip of each class is held out
    other = tmp_path.parent / (tmp_path.name + "-plain")
    for i in range(3):
        _write_clip(other / "jump" / f"clip{i}", 3, 10 * i)
    (train_x, _), (test_x, _), _ = video_data.folder_split(other, 2, 8, test_every=2)
    assert len(train_x) == 1 and len(test_x) == 2
    with pytest.raises(ValueError, match="data"):
        video_data.folder_split(tmp_path / "nothing", 4, 8)


def test_video_main_reads_a_folder(tmp_path):
    root = tmp_path / "ucf"
    for cls in ("a", "b"):
        for g in (1, 8):
            _write_clip(root / cls / f"v_{cls}_g{g:02d}_c01", 4, 30 * g)
    out = tmp_path / "out"
    assert video_main(["--tiny", "--data", str(root), "--models", "base", "--out", str(out),
                       "--no-progress"]) == 0
    result = json.loads((out / "results" / "actions-ucf-tiny.json").read_text())
    assert result["classes"] == ["a", "b"] and result["data"] == "frames in ucf"


# --------------------------------------------------------------------------- README


def test_readme_tables_equal_the_committed_results():
    from examples.image.__main__ import HERE as IMAGE_DIR
    from examples.image.__main__ import render as render_image
    from examples.video.__main__ import HERE as VIDEO_DIR
    from examples.video.__main__ import render as render_video
    from examples.vision_common import README

    text = README.read_text()
    assert "## Images and video" in text
    for folder, render, name in ((IMAGE_DIR, render_image, "image"),
                                 (VIDEO_DIR, render_video, "video")):
        if not (folder / "results").is_dir():
            pytest.skip(f"no committed {name} results yet")
        assert f"<!-- vision-results: {name} -->" in text
        assert render(check=True) is False, f"experiments guide {name} table is stale: run render"


# --------------------------------------------------------------------------- shared code


def test_default_scales_are_the_committed_configs():
    """``SCALES["cpu"]`` (the configs' defaults over :class:`ExperimentConfig`'s) is what the
    committed results were made with, and the backbone gets the example's own sizes."""
    from examples.image.__main__ import HERE as IMAGE_DIR
    from examples.video.__main__ import HERE as VIDEO_DIR
    from examples.video.train import SCALES as VIDEO_SCALES

    for folder, name, scales in ((IMAGE_DIR, "masked", IMAGE_SCALES),
                                 (VIDEO_DIR, "actions", VIDEO_SCALES)):
        path = folder / "results" / f"{name}.json"
        if not path.exists():
            pytest.skip(f"no committed {name} results yet")
        config = json.loads(json.dumps(scales["cpu"].as_dict()))
        committed = json.loads(path.read_text())["config"]
        # a committed run may add models on request (``--models ... memory_warp``): the
        # default models come first, every other field is the default's
        models = committed.pop("models")
        assert models[:len(config["models"])] == config.pop("models")
        assert config == committed
    assert IMAGE_SCALES["tiny"].backbone().window == 1  # an image field reaches the backbone
    assert VIDEO_SCALES["full"].backbone().grid == (8, 8, 8)
    assert VIDEO_SCALES["tiny"].lr == VideoConfig().lr == 2e-3  # the video default, not the base's


def test_result_names():
    from pathlib import Path

    from examples.vision_common import result_name

    assert result_name("masked", "cpu", None) == ("masked", "")
    assert result_name("masked", "tiny", None) == ("masked-tiny", "-masked-tiny")
    assert result_name("actions", "full", Path("/d/ucf")) == ("actions-ucf-full",
                                                             "-actions-ucf-full")
