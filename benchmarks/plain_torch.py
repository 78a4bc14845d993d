"""A plain autograd implementation of the layer's math (docs/LAYER.md) with ordinary torch ops.

This is the comparison baseline of the benchmark suite: the layer written the
straightforward way (``nn.Linear``, depthwise ``Conv3d``, ``grid_sample``,
elementwise ops), differentiated by torch autograd, which stores every
intermediate of every chunk step. Parameter names and layouts follow the
tmcore layer (``docs/LAYER.md``) so the same state dict loads into both
and the gradients can be compared one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainTensorMemory", "plain_scan"]


def _gaussian_weights(mu: torch.Tensor, sigma: torch.Tensor, shape, eps: float) -> torch.Tensor:
    """``mu (B, 3)`` (x, y, z order), ``sigma (B,)`` -> ``w (B, D, H, W)``."""
    axes = [torch.linspace(-1.0, 1.0, s, dtype=mu.dtype, device=mu.device) for s in shape]
    zz, yy, xx = torch.meshgrid(*axes, indexing="ij")
    centres = torch.stack([xx, yy, zz], dim=-1)  # (D, H, W, 3) in coordinate order
    dist2 = ((centres[None] - mu[:, None, None, None, :]) ** 2).sum(-1)
    return torch.exp(-dist2 / (2.0 * sigma[:, None, None, None] ** 2 + eps))


def plain_scan(
    h: torch.Tensor,  # [B, C, D, H, W]
    c: torch.Tensor,  # [B, C, D, H, W]
    read_coords: torch.Tensor,  # [B, T, 3]
    write_coords: torch.Tensor,  # [B, T, 3]
    write_sigma: torch.Tensor,  # [B, T]
    write_content: torch.Tensor,  # [B, T, C]
    convs: nn.ModuleList,  # depthwise Conv3d along D, H, W
    pointwise: nn.Conv3d,  # 2C -> 4C, kernel 1
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk recurrence, step by step, with autograd storing everything."""
    batch, channels = h.shape[:2]
    shape = tuple(h.shape[2:])
    reads = []
    for t in range(read_coords.shape[1]):
        grid = read_coords[:, t].reshape(batch, 1, 1, 1, 3)
        read = F.grid_sample(h, grid, mode="bilinear", padding_mode="border", align_corners=True)
        reads.append(read.reshape(batch, channels))
        w = _gaussian_weights(write_coords[:, t], write_sigma[:, t], shape, eps)
        written = write_content[:, t, :, None, None, None] * w[:, None]
        y = torch.cat([written, h], dim=1)
        for conv in convs:
            y = conv(y)
        i, f, o, g = pointwise(y).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    return torch.stack(reads, dim=1), h, c


class PlainTensorMemory(nn.Module):
    """The memory layer as a plain autograd module (3-D grids only).

    ``forward(x (B, N, d), state=None) -> (read projection (B, N, d), (h, c))``;
    the output is ``out_proj(read)`` broadcast to every token of its chunk (no
    residual), like :func:`tmcore`'s layer math in ``docs/LAYER.md``.
    """

    def __init__(self, embed_dim: int, memory_channels: int, memory_shape, chunk_size: int,
                 sigma_scale: float = 1.0, eps: float = 1e-6):
        super().__init__()
        if len(memory_shape) != 3:
            raise ValueError(f"memory_shape: expected 3 spatial axes, got {memory_shape!r}")
        d, ch, two = embed_dim, memory_channels, 2 * memory_channels
        self.memory_shape = tuple(memory_shape)
        self.chunk_size = chunk_size
        self.channels = ch
        self.sigma_scale = sigma_scale
        self.eps = eps
        self.write_proj = nn.Linear(chunk_size * d, d)
        self.content_net = nn.Linear(d, ch)
        self.sigma_net = nn.Linear(d, 1)
        self.coord_net = nn.Linear(d, 3)
        self.out_proj = nn.Linear(ch, d)
        kernels = [(3, 1, 1), (1, 3, 1), (1, 1, 3)]
        pads = [(1, 0, 0), (0, 1, 0), (0, 0, 1)]
        self.convs = nn.ModuleList(
            nn.Conv3d(two, two, k, padding=p, groups=two)
            for k, p in zip(kernels, pads, strict=True)
        )
        self.pointwise = nn.Conv3d(two, 4 * ch, 1)
        with torch.no_grad():
            self.sigma_net.bias.fill_(1.0)

    def load_tm_state_dict(self, sd: dict) -> None:
        """Load a tmcore layer state dict (``cell.*`` in tmcore's ConvParams layout)."""
        ours = {k: v for k, v in sd.items() if not k.startswith("cell.")}
        dw, db = sd["cell.depthwise_weight"], sd["cell.depthwise_bias"]
        for axis, conv in enumerate(self.convs):
            ours[f"convs.{axis}.weight"] = dw[axis].reshape(conv.weight.shape)
            ours[f"convs.{axis}.bias"] = db[axis]
        pw = sd["cell.pointwise_weight"]
        ours["pointwise.weight"] = pw.reshape(*pw.shape, 1, 1, 1)
        ours["pointwise.bias"] = sd["cell.pointwise_bias"]
        self.load_state_dict({k: torch.as_tensor(v) for k, v in ours.items()}, strict=True)

    def tm_grads(self) -> dict:
        """Parameter gradients under tmcore's names and layouts."""
        grads = {name: p.grad for name, p in self.named_parameters()
                 if not name.startswith(("convs.", "pointwise."))}
        grads["cell.depthwise_weight"] = torch.stack(
            [conv.weight.grad.reshape(-1, 3) for conv in self.convs])
        grads["cell.depthwise_bias"] = torch.stack([conv.bias.grad for conv in self.convs])
        grads["cell.pointwise_weight"] = self.pointwise.weight.grad.flatten(1)
        grads["cell.pointwise_bias"] = self.pointwise.bias.grad
        return grads

    def tm_state_dict(self) -> dict:
        """This module's parameters under tmcore's names and layouts (detached copies)."""
        sd = {name: p.detach().clone() for name, p in self.named_parameters()
              if not name.startswith(("convs.", "pointwise."))}
        sd["cell.depthwise_weight"] = torch.stack(
            [conv.weight.detach().reshape(-1, 3) for conv in self.convs])
        sd["cell.depthwise_bias"] = torch.stack([conv.bias.detach() for conv in self.convs])
        sd["cell.pointwise_weight"] = self.pointwise.weight.detach().flatten(1).clone()
        sd["cell.pointwise_bias"] = self.pointwise.bias.detach().clone()
        return sd

    def scan(self, h, c, read_coords, write_coords, write_sigma, write_content):
        """The recurrence (subclasses swap in another implementation)."""
        return plain_scan(h, c, read_coords, write_coords, write_sigma, write_content,
                          self.convs, self.pointwise, self.eps)

    def init_state(self, batch: int, device=None, dtype=None):
        h = torch.zeros(batch, self.channels, *self.memory_shape, device=device, dtype=dtype)
        return h, torch.zeros_like(h)

    def forward(self, x: torch.Tensor, state=None):
        batch, tokens, d = x.shape
        size = self.chunk_size
        steps = -(-tokens // size)
        if steps * size != tokens:
            x = F.pad(x, (0, 0, 0, steps * size - tokens))
        chunks = x.reshape(batch, steps, size, d)
        h, c = self.init_state(batch, x.device, x.dtype) if state is None else state
        read_coords = torch.tanh(self.coord_net(chunks[:, :, 0]))
        summary = self.write_proj(chunks.reshape(batch, steps, size * d))
        write_coords = torch.tanh(self.coord_net(summary))
        content = self.content_net(summary)
        sigma = (F.softplus(self.sigma_net(summary))[..., 0] + 1e-4) * self.sigma_scale
        reads, h, c = self.scan(h, c, read_coords, write_coords, sigma, content)
        out = self.out_proj(reads)  # (B, T, d)
        out = out[:, :, None, :].expand(batch, steps, size, d).reshape(batch, steps * size, d)
        return out[:, :tokens], (h, c)
