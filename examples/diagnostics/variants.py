"""A pure-PyTorch Tensor Memory with ablation switches (examples only).

:class:`VariantTensorMemory` follows DESIGN's layer math and the adapter's
parameter names (``write_proj``, ``content_net``, ``sigma_net``, ``coord_net``,
``cell.*``, ``out_proj``), so that with the default switches it computes the
same function as ``tmcore.adapters.torch.TensorMemory`` (checked in
``tests/test_diagnostics_smoke.py``). It exists for the ablations, which need
options the adapter does not offer:

- ``write="hard"``: the content goes to the single nearest cell (no spread,
  no gradient to the write coordinate) instead of a Gaussian splat;
- ``tied=False``: separate coordinate heads for reads and writes;
- ``conv="pointwise"``: no depthwise taps, only the pointwise gate mixing.

Only 3-D grids (``memory_shape = (D, H, W)``). State is ``(h, c)``, each
``(B, C, D, H, W)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VariantTensorMemory"]

State = tuple[torch.Tensor, torch.Tensor]


class _Cell(nn.Module):
    """Factorized-conv ConvLSTM gate parameters, named like the adapter's ``cell``."""

    def __init__(self, channels: int, ndim: int) -> None:
        super().__init__()
        c_in, c_out = 2 * channels, 4 * channels
        taps = torch.zeros(ndim, c_in, 3)
        taps[:, :, 1] = 1.0
        self.depthwise_weight = nn.Parameter(taps)  # (n, 2C, 3)
        self.depthwise_bias = nn.Parameter(torch.zeros(ndim, c_in))  # (n, 2C)
        bound = math.sqrt(6.0 / (c_in + c_out))
        self.pointwise_weight = nn.Parameter(torch.empty(c_out, c_in).uniform_(-bound, bound))
        self.pointwise_bias = nn.Parameter(torch.zeros(c_out))  # (4C,)


class VariantTensorMemory(nn.Module):
    """Tensor Memory with ablation switches; ``forward(x (B, N, d), state) -> (out, state)``.

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale :
        as in ``tmcore.adapters.torch.TensorMemory``.
    write : ``"gaussian"`` (default) or ``"hard"`` (nearest cell, one-hot).
    tied : one shared coordinate head for reads and writes (default) or two.
    conv : ``"factorized"`` (default) or ``"pointwise"`` (depthwise taps off).
    """

    def __init__(
        self, embed_dim: int, memory_channels: int, memory_shape: tuple[int, int, int],
        chunk_size: int, sigma_scale: float = 1.0, *, write: str = "gaussian",
        tied: bool = True, conv: str = "factorized",
    ) -> None:
        super().__init__()
        if len(memory_shape) != 3:
            raise ValueError(f"memory_shape: expected (D, H, W), got {memory_shape}")
        if write not in ("gaussian", "hard") or conv not in ("factorized", "pointwise"):
            raise ValueError(f"unknown variant write={write!r} conv={conv!r}")
        d, C = embed_dim, memory_channels
        self.embed_dim, self.memory_channels = d, C
        self.memory_shape = tuple(memory_shape)
        self.chunk_size, self.sigma_scale = chunk_size, sigma_scale
        self.write_mode, self.tied, self.conv_mode = write, tied, conv
        self.write_proj = nn.Linear(chunk_size * d, d)
        self.content_net = nn.Linear(d, C)
        self.sigma_net = nn.Linear(d, 1)
        nn.init.constant_(self.sigma_net.bias, 1.0)
        self.coord_net = nn.Linear(d, 3)
        if not tied:
            self.write_coord_net = nn.Linear(d, 3)
        self.cell = _Cell(C, 3)
        self.out_proj = nn.Linear(C, d)

    def init_state(self, batch: int, device=None, dtype=None) -> State:
        """Zero state ``(h, c)``, each ``(batch, C, D, H, W)``."""
        shape = (batch, self.memory_channels, *self.memory_shape)
        return (torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype))

    # -- addressing -------------------------------------------------------------------------
    def _write_volumes(self, coords: torch.Tensor, sigma: torch.Tensor,
                       content: torch.Tensor) -> torch.Tensor:
        """Written volumes ``(B, T, C, D, H, W)`` from coords ``(B, T, 3)`` (x, y, z order),
        sigma ``(B, T)`` and content ``(B, T, C)``."""
        profiles = []
        for axis, size in enumerate(self.memory_shape):  # D, H, W  <- z, y, x
            centres = torch.linspace(-1.0, 1.0, size, device=coords.device, dtype=coords.dtype)
            mu = coords[..., 2 - axis, None]  # (B, T, 1)
            if self.write_mode == "hard":
                index = torch.round((mu.detach() + 1) / 2 * (size - 1)).clamp(0, size - 1)
                profile = F.one_hot(index[..., 0].long(), size).to(coords.dtype)
            else:
                denom = 2.0 * sigma[..., None] ** 2 + 1e-6
                profile = torch.exp(-((centres - mu) ** 2) / denom)
            profiles.append(profile)  # (B, T, S_a)
        pz, py, px = profiles
        weight = pz[..., :, None, None] * py[..., None, :, None] * px[..., None, None, :]
        return content[..., None, None, None] * weight[:, :, None]

    def _depthwise(self, v: torch.Tensor, channels: slice) -> torch.Tensor:
        """Axis-by-axis depthwise 3-tap convs (D, then H, then W, zero padding) on
        ``v (B', C, D, H, W)``; shifts and multiplies (much faster than grouped conv3d on CPU)."""
        if self.conv_mode == "pointwise":
            return v
        w, b = self.cell.depthwise_weight[:, channels], self.cell.depthwise_bias[:, channels]
        view = (1, -1, 1, 1, 1)
        for axis in range(3):
            dim, size = 2 + axis, v.shape[2 + axis]
            pad = [0] * 6
            pad[2 * (2 - axis)] = pad[2 * (2 - axis) + 1] = 1
            padded = F.pad(v, pad)
            taps = w[axis]  # (C, 3): previous, centre, next
            v = (taps[:, 0].reshape(view) * padded.narrow(dim, 0, size)
                 + taps[:, 1].reshape(view) * v
                 + taps[:, 2].reshape(view) * padded.narrow(dim, 2, size)
                 + b[axis].reshape(view))
        return v

    def _depthwise_operator(self, channels: slice) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The depthwise chain as one linear map per channel: ``(K (C, P, P), bias (C, P))``
        with ``P = D*H*W``, so that ``depthwise(v) = K @ v + bias`` cell-wise.

        K is the Kronecker product of the three tridiagonal axis matrices; the
        bias field is the chain applied to zeros (position dependent at the
        zero-padded borders). One batched matmul per step instead of a dozen
        small elementwise ops: about 3x faster on CPU.
        """
        if self.conv_mode == "pointwise":
            return None
        w = self.cell.depthwise_weight[:, channels]  # (3, C, 3)
        mats = []
        for axis, size in enumerate(self.memory_shape):
            eye = torch.eye(size, dtype=w.dtype, device=w.device)
            below, above = eye.roll(-1, dims=1).triu(-1).tril(-1), eye.roll(1, dims=1).triu(1)
            taps = w[axis][:, :, None, None]  # (C, 3, 1, 1)
            mats.append(taps[:, 0] * below + taps[:, 1] * eye + taps[:, 2] * above)
        md, mh, mw = mats
        C, (D, H, W) = w.shape[1], self.memory_shape
        kron = torch.einsum("cad,cbe,cfg->cabfdeg", md, mh, mw).reshape(C, D * H * W, D * H * W)
        zeros = w.new_zeros(1, C, D, H, W)
        return kron, self._depthwise(zeros, channels).reshape(C, D * H * W)

    def _apply_depthwise(self, v: torch.Tensor, channels: slice,
                         operator: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """The depthwise chain on ``v (B', C, D, H, W)`` through :meth:`_depthwise_operator`."""
        if self.conv_mode == "pointwise":
            return v
        kron, field = operator if operator is not None else self._depthwise_operator(channels)
        flat = torch.bmm(v.reshape(v.shape[0], v.shape[1], -1).transpose(0, 1),
                         kron.transpose(1, 2))  # (C, B', P)
        return (flat.transpose(0, 1) + field).reshape(v.shape)

    def _pointwise(self, v: torch.Tensor, channels: slice) -> torch.Tensor:
        """``P[:, channels] @ v`` over the channel axis of ``v (B', C, D, H, W)``."""
        weight = self.cell.pointwise_weight[:, channels]
        out = torch.matmul(weight, v.reshape(v.shape[0], v.shape[1], -1))
        return out.reshape(v.shape[0], weight.shape[0], *v.shape[2:])

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        """``x (B, N, d)`` -> ``out (B, N, d)``, final state ``(h, c)``."""
        B, N, d = x.shape
        L, C = self.chunk_size, self.memory_channels
        T = -(-N // L)
        if T * L != N:
            x = F.pad(x, (0, 0, 0, T * L - N))
        chunks = x.reshape(B, T, L, d)
        summary = self.write_proj(chunks.reshape(B, T, L * d))
        read_coords = torch.tanh(self.coord_net(chunks[:, :, 0]))
        write_head = self.coord_net if self.tied else self.write_coord_net
        write_coords = torch.tanh(write_head(summary))
        sigma = (F.softplus(self.sigma_net(summary))[..., 0] + 1e-4) * self.sigma_scale
        written = self._write_volumes(write_coords, sigma, self.content_net(summary))
        # The x half of the gate pre-activations is linear in x: do it for all steps at once.
        flat = written.reshape(B * T, C, *self.memory_shape)
        zx = self._pointwise(self._apply_depthwise(flat, slice(0, C)), slice(0, C))
        zx = zx.reshape(B, T, 4 * C, *self.memory_shape)
        bias = self.cell.pointwise_bias.reshape(4 * C, 1, 1, 1)
        h, c = state if state is not None else self.init_state(B, x.device, x.dtype)
        h_operator = self._depthwise_operator(slice(C, 2 * C))
        reads = []
        # unbind (not zx[:, t]): its backward stacks once instead of T full-size scatters.
        for zx_t, read_t in zip(zx.unbind(1), read_coords.unbind(1), strict=True):
            grid = read_t.reshape(B, 1, 1, 1, 3)
            reads.append(F.grid_sample(h, grid, mode="bilinear", padding_mode="border",
                                       align_corners=True).reshape(B, C))
            z = zx_t + self._pointwise(self._apply_depthwise(h, slice(C, 2 * C), h_operator),
                                       slice(C, 2 * C))
            z = z + bias
            i, f, o = torch.sigmoid(z[:, :3 * C]).chunk(3, dim=1)
            c = f * c + i * torch.tanh(z[:, 3 * C:])
            h = o * torch.tanh(c)
        out = self.out_proj(torch.stack(reads, dim=1))  # (B, T, d)
        out = out.repeat_interleave(L, dim=1)[:, :N]
        return out, (h, c)
