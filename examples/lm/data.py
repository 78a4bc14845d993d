"""Byte-level text for the LM comparison: CPython's help topics, or WikiText-2 raw files.

Both give ``(train, heldout)`` as 1-D int64 tensors of bytes (values 0..255).

* default: ``pydoc_data.topics`` (ships with CPython, no download). Topics whose text is
  identical are kept once (deduplicated); every ``heldout_every``-th topic in sorted-name
  order is held out, so no held-out text appears in training.
* ``--data PATH``: a folder with WikiText-2's ``wiki.train.raw``, ``wiki.valid.raw`` and
  ``wiki.test.raw``; training uses the train file, the held-out score uses the test file
  (the split the paper's perplexity is reported on).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["pydoc_split", "wikitext_split", "load_split", "WIKITEXT_FILES"]

WIKITEXT_FILES = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def pydoc_split(heldout_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, heldout)`` bytes of the deduplicated help topics (see the module doc)."""
    if heldout_every < 2:
        raise ValueError(f"heldout_every: expected an int >= 2, got {heldout_every}")
    from pydoc_data.topics import topics

    seen, train, held = set(), [], []
    for name in sorted(topics):
        text = topics[name]
        if text in seen:  # duplicates would leak held-out text into training
            continue
        seen.add(text)
        (held if len(seen) % heldout_every == 0 else train).append(text)
    return _bytes("\n\n".join(train)), _bytes("\n\n".join(held))


def wikitext_split(path: Path) -> dict[str, torch.Tensor]:
    """``{"train", "valid", "test"}`` bytes from WikiText-2's raw files in folder ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"data: expected a folder holding {', '.join(WIKITEXT_FILES)}, "
                         f"got {path}")
    missing = [f for f in WIKITEXT_FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"data: {path} lacks {', '.join(missing)} (WikiText-2 raw files)")
    out = {}
    for name, file in zip(("train", "valid", "test"), WIKITEXT_FILES, strict=True):
        text = (path / file).read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"data: {path / file} is empty")
        out[name] = _bytes(text)
    return out


def load_split(data: str | Path | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(train, heldout, description)`` for ``--data`` (``None``: the help topics)."""
    if data is None:
        train, held = pydoc_split()
        return train, held, "CPython pydoc_data.topics (deduplicated, every 10th topic held out)"
    parts = wikitext_split(Path(data))
    return parts["train"], parts["test"], f"WikiText-2 raw ({Path(data).name}: train / test)"
