"""Results file, table, plot and pictures of the masked-patch reconstruction example.

``rows``: one per (model, metric, setting) with ``seeds`` = the value of each
seed (in the order of the top-level ``seeds``): metrics ``psnr`` (dB) and
``ssim`` at settings ``"25%"``, ``"50%"``, ``"75%"`` (mask ratio), and
``step_ms`` (median wall-clock of one training step) at setting ``"train"``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from examples import vision_common as common
from examples.image.train import LABELS

plt = common.pyplot()

__all__ = ["build_results", "table", "markdown", "plot_metrics", "picture", "setting"]


def setting(ratio: float) -> str:
    return f"{round(100 * ratio)}%"


def build_results(records: list[dict], config: dict, command: str, data: str,
                  threads: int, device: str, seconds: float,
                  provenance: dict | None = None) -> dict:
    """The results dictionary from per-run records; ``provenance``: ``commit_info()`` taken
    when the run started (default: now)."""

    def metric_rows(model: str, by_seed: dict, seeds: list) -> list[dict]:
        return [{"model": model, "metric": metric, "setting": setting(ratio),
                 "seeds": [round(by_seed[s][metric][str(ratio)], digits) for s in seeds]}
                for metric, digits in (("psnr", 3), ("ssim", 4)) for ratio in config["ratios"]]

    return common.results_dict("masked-patch reconstruction", records, metric_rows, config,
                               command, data, threads, device, seconds, provenance)


def table(result: dict, timing: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: PSNR and SSIM per mask ratio, mean ± std over seeds; ms per
    training step from ``timing`` (the interleaved measurement) when given."""
    ratios = [setting(r) for r in result["config"]["ratios"]]
    header = ["model", "params", "ms / step",
              *[f"PSNR {s}" for s in ratios], *[f"SSIM {s}" for s in ratios]]
    return header, common.model_rows(result, timing, LABELS, lambda m, ms: [
        f"{statistics.fmean(ms):.0f}",
        *[common.mean_std(common.row_values(result, m, "psnr", s)) for s in ratios],
        *[common.mean_std(common.row_values(result, m, "ssim", s), 3) for s in ratios]])


def markdown(result: dict, name: str, timing: dict | None = None) -> str:
    """Title line, table and source line (the README block)."""
    c = result["config"]
    head = (f"*Masked-patch reconstruction, {result['data']}: {c['size']}x{c['size']} images, "
            f"{c['patch']}x{c['patch']} patches, width {c['width']}, depth {c['depth']}, "
            f"{c['steps']} steps; held-out images; PSNR (dB) and SSIM of the composite, "
            f"mean ± std over seeds {result['seeds']}.*")
    return common.readme_block("image", name, head, result, timing, table)


def plot_metrics(result: dict, path: Path) -> None:
    """PSNR and SSIM against the mask ratio, one line per model, std over seeds as bars."""
    ratios = [setting(r) for r in result["config"]["ratios"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, metric, name in ((axes[0], "psnr", "PSNR (dB)"), (axes[1], "ssim", "SSIM")):
        for m in result["params"]:
            values = [common.row_values(result, m, metric, s) for s in ratios]
            mean = [statistics.fmean(v) for v in values]
            std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            ax.errorbar(ratios, mean, yerr=std, marker="o", capsize=3, label=LABELS.get(m, m))
        ax.set_xlabel("mask ratio")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Masked-patch reconstruction ({result['data']}), seeds {result['seeds']}",
                 fontsize=10)
    common.save_figure(fig, path, 110)


def picture(target: np.ndarray, masks: dict[str, np.ndarray], recons: dict[str, np.ndarray],
            patch: int, title: str, path: Path) -> None:
    """Rows of held-out images: target, then for each mask ratio the masked input (masked
    patches grey) and the reconstruction. ``target (B, C, H, W)``; ``masks[s] (B, N)``
    bool; ``recons[s] (B, C, H, W)``."""
    b, _, size, _ = target.shape
    grid = size // patch
    cols = 1 + 2 * len(masks)
    fig, axes = plt.subplots(b, cols, figsize=(1.3 * cols, 1.3 * b + 0.4), squeeze=False)
    for i in range(b):
        panels = [("target", target[i])]
        for s, mask in masks.items():
            pixel_mask = np.kron(mask[i].reshape(grid, grid), np.ones((patch, patch))) > 0
            masked = np.where(pixel_mask[None], 0.5, target[i])
            panels += [(f"masked {s}", masked), (f"recon. {s}", recons[s][i])]
        for ax, (name, image) in zip(axes[i], panels, strict=True):
            ax.imshow(np.clip(image.transpose(1, 2, 0), 0, 1), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(name, fontsize=7)
    fig.suptitle(title, fontsize=9)
    common.save_figure(fig, path, 90)
