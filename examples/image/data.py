"""Images for masked-patch reconstruction: offline crops, or an ImageFolder-style directory.

Both return float32 arrays ``(N, 3, size, size)`` in ``[0, 1]`` (grey images are
repeated over the three channels).

- :func:`bundled_split`: crops of the photographs that ship inside scikit-image
  (no download). The held-out images are whole photographs the model never sees
  in training (:data:`TEST_IMAGES`), not other crops of the training photographs.
- :func:`folder_split`: ``root/<class>/<image>`` (e.g. CUB-200-2011's ``images/``),
  every image resized (shorter side) and centre-cropped to ``size``; every
  ``test_every``-th file of each class (sorted by name) is held out.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from examples.vision_common import center_crop

__all__ = ["TRAIN_IMAGES", "TEST_IMAGES", "bundled_split", "folder_split", "load_image",
           "random_crops", "EXTENSIONS"]

#: scikit-image's bundled photographs (``skimage.data``), none of which needs a download.
TRAIN_IMAGES = ("astronaut", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
                "brick", "grass", "gravel", "moon", "page", "text", "cell", "clock")
TEST_IMAGES = ("chelsea", "coffee", "camera", "coins")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
SCALES = (2, 4)  # downscale factors: crops of 32 then cover 64 / 128 pixels of the photograph


def _to_rgb_float(image: np.ndarray) -> np.ndarray:
    """``(H, W[, C])`` any dtype -> ``(H, W, 3)`` float32 in [0, 1]."""
    from skimage import img_as_float32

    image = img_as_float32(image)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    return np.ascontiguousarray(image[..., :3])


def _bundled(name: str) -> np.ndarray:
    import skimage.data

    return _to_rgb_float(getattr(skimage.data, name)())


@functools.lru_cache(maxsize=4)
def _photographs(names: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """Every scale of every named photograph (cached: decoding them takes a while)."""
    return tuple(p for name in names for p in _pyramid(_bundled(name)))


def _pyramid(image: np.ndarray) -> list[np.ndarray]:
    """The image at each of :data:`SCALES` (area-averaged)."""
    from skimage.transform import downscale_local_mean

    return [downscale_local_mean(image, (s, s, 1)).astype(np.float32) for s in SCALES]


def random_crops(images: list[np.ndarray], count: int, size: int,
                 rng: np.random.Generator, flips: bool) -> np.ndarray:
    """``count`` random ``size x size`` crops (uniform over images, then positions),
    optionally flipped left-right; ``(count, 3, size, size)``."""
    usable = [im for im in images if im.shape[0] >= size and im.shape[1] >= size]
    if not usable:
        raise ValueError(f"size: every image is smaller than {size} pixels")
    out = np.empty((count, 3, size, size), np.float32)
    for i in range(count):
        im = usable[rng.integers(len(usable))]
        y = rng.integers(im.shape[0] - size + 1)
        x = rng.integers(im.shape[1] - size + 1)
        crop = im[y:y + size, x:x + size]
        if flips and rng.random() < 0.5:
            crop = crop[:, ::-1]
        out[i] = crop.transpose(2, 0, 1)
    return out


def bundled_split(size: int, train_count: int, test_count: int, seed: int,
                  test_seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """Training crops (drawn with ``seed``) and held-out crops (``test_seed``: the same for
    every model and seed) from scikit-image's bundled photographs."""
    train, test = list(_photographs(TRAIN_IMAGES)), list(_photographs(TEST_IMAGES))
    return (random_crops(train, train_count, size, np.random.default_rng(seed), flips=True),
            random_crops(test, test_count, size, np.random.default_rng(test_seed), flips=False))


def load_image(path: Path, size: int) -> np.ndarray:
    """One file -> ``(3, size, size)`` float32: shorter side resized to ``size`` (bicubic),
    centre crop."""
    from PIL import Image

    return center_crop(path, size, Image.Resampling.BICUBIC)


def folder_split(root: Path, size: int, test_every: int = 10,
                 limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``root/<class>/<image file>`` -> (train, test) arrays ``(N, 3, size, size)``.

    Files of each class are sorted by name; every ``test_every``-th (the 1st, the
    ``test_every+1``-th, ...) is held out, so each class appears in both splits.
    ``limit``: at most this many files per class (quick runs)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"data: expected a directory of class folders, got {str(root)!r}")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    train, test = [], []
    for folder in classes:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in EXTENSIONS)
        for i, path in enumerate(files[:limit]):
            (test if i % test_every == 0 else train).append(load_image(path, size))
    if not train or not test:
        raise ValueError(f"data: {str(root)!r} needs class folders with at least 2 images in "
                         f"all (found {len(train) + len(test)} in {len(classes)} folders)")
    return np.stack(train), np.stack(test)
