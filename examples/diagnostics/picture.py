"""A picture of the memory state: slices of ``h`` over time for one example."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from examples.diagnostics.models import Backbone  # noqa: E402
from examples.diagnostics.tasks import Task  # noqa: E402

__all__ = ["memory_states", "plot_memory_states"]


@torch.no_grad()
def memory_states(model: Backbone, task: Task, setting: dict, seed: int = 0) -> np.ndarray:
    """``||h||`` over channels after every chunk of one example: ``(T, D, H, W)``.

    Runs the model once with input recording on, then streams the first
    memory's recorded input chunk by chunk through ``memory(x, state)``,
    carrying the returned state (the streaming contract of the adapter).
    """
    residual = model.memories()[0]
    batch = task.batch(np.random.default_rng(seed), 1, setting)
    residual.record_inputs = True
    model.eval()
    model(torch.from_numpy(batch.inputs).to(next(model.parameters()).device))
    residual.record_inputs = False
    x = residual.last_input  # (1, N, d)
    memory = residual.memory
    step = getattr(memory, "chunk_size", 1)
    state, norms = None, []
    for start in range(0, x.shape[1], step):
        _, state = memory(x[:, start:start + step], state)
        h = state[0]  # (1, C, D, H, W)
        norms.append(h[0].norm(dim=0).cpu().numpy())
    model.train()
    return np.stack(norms)


def plot_memory_states(norms: np.ndarray, path: Path, title: str, n_times: int = 6) -> None:
    """Grid of ``||h||`` depth slices (columns) at ``n_times`` evenly spaced steps (rows)."""
    T, D = norms.shape[:2]
    times = np.unique(np.linspace(0, T - 1, min(n_times, T)).round().astype(int))
    fig, axes = plt.subplots(len(times), D, figsize=(1.4 * D + 1, 1.4 * len(times) + 0.6),
                             squeeze=False)
    vmax = float(norms.max()) or 1.0
    for r, t in enumerate(times):
        for z in range(D):
            ax = axes[r][z]
            ax.imshow(norms[t, z], vmin=0, vmax=vmax, cmap="magma")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"z={z}", fontsize=8)
            if z == 0:
                ax.set_ylabel(f"t={t + 1}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
