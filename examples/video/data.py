"""Clips for action recognition: procedural motion patterns, or extracted frames on disk.

Both give float32 clips ``(N, T, C, size, size)`` in ``[0, 1]`` and int64 labels ``(N,)``.

- :func:`procedural`: one shape (square, disk, cross or ring; random size,
  brightness and start) moves over a noisy background; its class is its motion
  pattern (:data:`CLASSES`), never its shape. An occluder (a grey curtain over
  the whole view) hides everything for a run of ``0..max_occlusion``
  consecutive frames (length and start drawn per clip), so a model must carry
  what it saw across the gap.
- :func:`folder_split`: extracted frames in the UCF-101 layout
  ``root/<class>/<clip>/<frame image>`` (frames sorted by name; ``T`` of them
  taken evenly spaced). Clips named like UCF-101's ``v_<Action>_gXX_cYY`` are
  split by group as UCF-101's split 1 (groups 1-7 held out); other names: every
  ``test_every``-th clip of each class is held out.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from examples.vision_common import center_crop

__all__ = ["CLASSES", "procedural", "folder_split", "EXTENSIONS"]

#: Motion patterns; the last two name positions: out along x (y) and back to the start.
CLASSES = ("right", "left", "down", "up", "down-right", "up-left", "clockwise",
           "counter-clockwise", "left-right-left", "up-down-up")
SHAPES = ("square", "disk", "cross", "ring")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
_GROUP = re.compile(r"_g(\d+)_c\d+", re.IGNORECASE)


def _stamp(shape: str, radius: float) -> np.ndarray:
    """A ``(k, k)`` float mask of ``shape`` with about ``radius`` pixels of half-width."""
    r = int(np.ceil(radius))
    yy, xx = np.mgrid[-r:r + 1, -r:r + 1].astype(np.float32)
    dist = np.sqrt(yy ** 2 + xx ** 2)
    if shape == "square":
        return np.ones_like(dist)
    if shape == "disk":
        return (dist <= radius + 0.3).astype(np.float32)
    if shape == "cross":
        return ((np.abs(yy) <= 0.5) | (np.abs(xx) <= 0.5)).astype(np.float32)
    return ((dist <= radius + 0.3) & (dist >= radius - 1.0)).astype(np.float32)  # ring


def _path(label: int, frames: int, size: int, margin: float,
          rng: np.random.Generator) -> np.ndarray:
    """``(frames, 2)`` centre positions ``(y, x)`` of motion pattern ``label``."""
    t = np.arange(frames, dtype=np.float32)
    lo, hi = margin, size - 1 - margin
    speed = rng.uniform(0.9, 1.4)
    span = speed * (frames - 1)
    name = CLASSES[label]
    if name in ("clockwise", "counter-clockwise"):
        half = (hi - lo) / 2
        radius = rng.uniform(min(2.5, half), min(4.5, half))
        cy, cx = (rng.uniform(lo + radius, hi - radius) for _ in range(2))
        phase = rng.uniform(0, 2 * np.pi)
        # about 3/4 of a turn: the direction of rotation is visible from any 3 frames
        turn = rng.uniform(1.3, 1.7) * np.pi / (frames - 1)
        sign = 1.0 if name == "clockwise" else -1.0  # y grows downwards: +angle is clockwise
        angle = phase + sign * turn * t
        return np.stack([cy + radius * np.sin(angle), cx + radius * np.cos(angle)], axis=1)
    if name in ("left-right-left", "up-down-up"):
        turn = int(rng.integers(frames // 2 - 1, frames // 2 + 2))
        offset = np.where(t <= turn, t, 2 * turn - t) * speed  # out and back
        reach = offset.max()
        start = rng.uniform(lo, max(lo, hi - reach))
        other = rng.uniform(lo, hi)
        moving = start + offset
        return np.stack([other + 0 * t, moving] if name == "left-right-left"
                        else [moving, other + 0 * t], axis=1)
    step = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0),
            "down-right": (1, 1), "up-left": (-1, -1)}[name]
    pos = []
    for d in step:
        if d == 0:
            pos.append(rng.uniform(lo, hi) + 0 * t)
        else:
            start = rng.uniform(lo, max(lo, hi - span)) if d > 0 else \
                rng.uniform(min(hi, lo + span), hi)
            pos.append(start + d * speed * t)
    return np.stack(pos, axis=1)


def procedural(count: int, frames: int, size: int, seed: int,
               max_occlusion: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``count`` clips ``(count, frames, 1, size, size)`` and balanced labels, from ``seed``.

    ``max_occlusion`` (default ``frames // 2``): the longest run of frames in which
    the view is hidden behind the occluder (0 to it, uniformly, per clip)."""
    if frames < 4 or size < 12:
        raise ValueError(f"frames, size: expected >= 4 frames of >= 12 pixels, got "
                         f"{frames}, {size}")
    rng = np.random.default_rng(seed)
    max_occlusion = frames // 2 if max_occlusion is None else max_occlusion
    labels = np.arange(count) % len(CLASSES)
    rng.shuffle(labels)
    clips = np.empty((count, frames, 1, size, size), np.float32)
    for i, label in enumerate(labels):
        shape = SHAPES[rng.integers(len(SHAPES))]
        radius = rng.uniform(1.2, 2.2)
        stamp = _stamp(shape, radius) * rng.uniform(0.6, 1.0)
        r = stamp.shape[0] // 2
        path = _path(int(label), frames, size, margin=r + 0.5, rng=rng)
        video = rng.uniform(0.05, 0.3) + rng.normal(0, 0.04, (frames, size, size))
        for f, (y, x) in enumerate(np.rint(path).astype(int)):
            y0, x0 = y - r, x - r
            ys, xs = slice(max(0, y0), min(size, y0 + 2 * r + 1)), \
                slice(max(0, x0), min(size, x0 + 2 * r + 1))
            piece = stamp[ys.start - y0:ys.stop - y0, xs.start - x0:xs.stop - x0]
            video[f, ys, xs] = np.maximum(video[f, ys, xs], piece)
        hidden = int(rng.integers(0, max_occlusion + 1))
        if hidden:  # an occluder covers the whole view for `hidden` consecutive frames
            first = int(rng.integers(0, frames - hidden + 1))
            video[first:first + hidden] = 0.5 + rng.normal(0, 0.02, (hidden, size, size))
        clips[i, :, 0] = np.clip(video, 0, 1)
    return clips, labels.astype(np.int64)


def _frame(path: Path, size: int) -> np.ndarray:
    """One frame -> ``(3, size, size)``: shorter side resized to ``size`` (bilinear), centre
    crop."""
    from PIL import Image

    return center_crop(path, size, Image.Resampling.BILINEAR)


def _is_test(name: str, index: int, test_every: int) -> bool:
    group = _GROUP.search(name)
    if group is not None:
        return int(group.group(1)) <= 7  # UCF-101 split 1: groups 1-7 are the test set
    return index % test_every == 0


def folder_split(root: Path, frames: int, size: int, test_every: int = 5,
                 limit: int | None = None) -> tuple[tuple[np.ndarray, np.ndarray],
                                                    tuple[np.ndarray, np.ndarray],
                                                    list[str]]:
    """``root/<class>/<clip>/<frames>`` -> ``((train clips, labels), (test clips, labels),
    class names)``; clips ``(N, frames, 3, size, size)``. ``limit``: clips per class."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"data: expected a directory root/<class>/<clip>/<frames>, "
                         f"got {str(root)!r}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    split: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}
    for label, name in enumerate(classes):
        clips = sorted(p for p in (root / name).iterdir() if p.is_dir())
        for index, clip in enumerate(clips[:limit]):
            files = sorted(p for p in clip.iterdir() if p.suffix.lower() in EXTENSIONS)
            if not files:
                continue
            take = np.linspace(0, len(files) - 1, frames).round().astype(int)
            video = np.stack([_frame(files[i], size) for i in take])
            xs, ys = split[_is_test(clip.name, index, test_every)]
            xs.append(video)
            ys.append(label)
    (train_x, train_y), (test_x, test_y) = split[False], split[True]
    if not train_x or not test_x:
        raise ValueError(f"data: {str(root)!r} gave {len(train_x)} training and {len(test_x)} "
                         f"held-out clips; both must be non-empty")
    return ((np.stack(train_x), np.asarray(train_y, np.int64)),
            (np.stack(test_x), np.asarray(test_y, np.int64)), classes)
