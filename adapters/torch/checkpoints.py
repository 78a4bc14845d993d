"""Checkpoints of the torch adapter: the paper's reference implementation's weights
(:func:`convert_reference_state_dict`), a memory with its config
(:func:`memory_to_dict` / :func:`memory_from_dict`) and a stream's state as tensors
(:func:`state_to_dict` / :func:`state_from_dict`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from tmcore import layer as tl
from tmcore.adapters.torch.modules import TensorMemory

__all__ = ["convert_reference_state_dict", "memory_from_dict", "memory_to_dict",
           "state_from_dict", "state_to_dict"]


#: the reference's linear layers -> TensorMemory's (``writer.*`` loses its prefix)
_RENAMED = {f"{layer}.{leaf}": f"{layer.removeprefix('writer.')}.{leaf}"
            for layer in ("write_proj", "writer.content_net", "writer.sigma_net", "coord_net",
                          "out_proj") for leaf in ("weight", "bias")}
_DEPTHWISE = ("gate_conv.conv_d", "gate_conv.conv_h", "gate_conv.conv_w")


def _reference_layout(d: int, c: int, length: int, grid: Sequence[int] | None
                      ) -> dict[str, tuple[tuple[int | None, ...], str]]:
    """Every reference key -> (expected shape, layout); ``None`` entries are free (the
    grid, when no target says it)."""
    layout: dict[str, tuple[tuple[int | None, ...], str]] = {
        "write_proj.weight": ((d, length * d), "(d, L*d)"),
        "write_proj.bias": ((d,), "(d,)"),
        "writer.content_net.weight": ((c, d), "(C, d)"),
        "writer.content_net.bias": ((c,), "(C,)"),
        "writer.sigma_net.weight": ((1, d), "(1, d)"),
        "writer.sigma_net.bias": ((1,), "(1,)"),
        "coord_net.weight": ((3, d), "(3, d)"),
        "coord_net.bias": ((3,), "(3,)"),
        "out_proj.weight": ((d, c), "(d, C)"),
        "out_proj.bias": ((d,), "(d,)"),
        "gate_conv.pointwise.weight": ((4 * c, 2 * c, 1, 1, 1), "(4C, 2C, 1, 1, 1)"),
        "gate_conv.pointwise.bias": ((4 * c,), "(4C,)"),
        "grid_cache": ((1, 3, *(grid or (None, None, None))), "(1, 3, D, H, W)"),
    }
    for axis, name in enumerate(_DEPTHWISE):
        kernel: list[int] = [1, 1, 1]
        kernel[axis] = 3
        layout[f"{name}.weight"] = ((2 * c, 1, *kernel), f"(2C, 1, {', '.join(map(str, kernel))})")
        layout[f"{name}.bias"] = ((2 * c,), "(2C,)")
    return layout


def _reference_sizes(own: Mapping[str, Tensor], prefix: str) -> tuple[int, int, int]:
    """``(d, C, L)`` of a reference state dict (n = 3), from ``out_proj.weight (d, C)``
    and ``write_proj.weight (d, L*d)`` (shapes only); ``ValueError`` naming the key."""
    out_proj, write_proj = own["out_proj.weight"], own["write_proj.weight"]
    if out_proj.dim() != 2 or min(out_proj.shape) < 1:
        raise ValueError(f"{prefix}out_proj.weight: expected shape (d, C), "
                         f"got {tuple(out_proj.shape)}")
    d, c = (int(s) for s in out_proj.shape)
    if write_proj.dim() != 2 or write_proj.shape[0] != d or write_proj.shape[1] % d \
            or write_proj.shape[1] == 0:
        raise ValueError(f"{prefix}write_proj.weight: expected shape (d, L*d) with d = {d} "
                         f"(from out_proj.weight), got {tuple(write_proj.shape)}")
    return d, c, int(write_proj.shape[1]) // d


def _target_state(target: Any) -> Mapping[str, Tensor]:
    """The state dict a target names: a :class:`TensorMemory` (its own) or a mapping."""
    if isinstance(target, TensorMemory):
        return target.state_dict()
    if isinstance(target, Mapping):
        return target
    raise TypeError(f"target: expected a TensorMemory or its state dict, "
                    f"got {type(target).__name__}")


def convert_reference_state_dict(
    sd: Mapping[str, Tensor], prefix: str = "", *, target: Any = None,
) -> dict[str, Tensor]:
    """Turn the paper's reference memory state dict into :class:`TensorMemory`'s.

    Only keys starting with ``prefix`` (e.g. ``"layers.0.memory."``) are read;
    the prefix is stripped. The reference's factorized conv (three depthwise
    ``Conv3d`` with kernels ``(3,1,1)``, ``(1,3,1)``, ``(1,1,3)`` and a 1x1x1
    pointwise ``Conv3d``) becomes ``cell.*``; ``writer.*`` loses its prefix;
    the ``grid_cache`` buffer ``(1, 3, D, H, W)`` (coordinates, recomputed by
    tmcore) becomes ``_extra_state``, the grid shape ``(D, H, W)`` (see
    :meth:`TensorMemory.get_extra_state`), so that loading refuses a model of
    another grid (without ``grid_cache`` there is no ``_extra_state`` and the
    grid is not checked). The result loads with
    ``TensorMemory(...).load_state_dict(result, strict=True)`` (a 3-D
    ``memory_shape``).

    ``target``: optionally the :class:`TensorMemory` (or its state dict) the result
    is for; every tensor's shape and dtype is then checked against the target's
    (and the grid against its ``memory_shape``), else against the layout that
    ``out_proj.weight (d, C)`` and ``write_proj.weight (d, L*d)`` fix.

    Everything is checked BEFORE anything is copied, from shapes and dtypes
    only, and nothing is copied that loading does not need: the result holds
    views of ``sd``'s tensors (renamed, reshaped; only the three depthwise
    kernels, ``O(C)`` values, are stacked into new tensors), so a hostile
    checkpoint of broadcast (stride-0) tensors claiming gigabytes converts in
    bytes, and its size mismatch with a target is refused before any
    allocation. Clone the result if you mean to modify it and keep ``sd``.

    Parameters
    ----------
    sd : mapping of str to Tensor
        The reference's state dict (or a model's holding it under ``prefix``).
    prefix : str, default ""
        Only keys starting with it are read (e.g. ``"layers.0.memory."``).
    target : TensorMemory, mapping of str to Tensor, or None, optional
        The model (or its state dict) the result is for: shapes, dtypes and
        the grid are checked against it.

    Returns
    -------
    dict of str to Tensor
        :class:`TensorMemory`'s state dict (views of ``sd``'s tensors where
        possible), ``_extra_state`` the grid ``(D, H, W)`` when ``sd`` has
        ``grid_cache``.

    Raises
    ------
    TypeError
        For an ``sd`` that is not a mapping with str keys, a value that is not a
        floating tensor (NumPy arrays and lists included: convert with
        ``torch.as_tensor``), or a dtype other than the target's.
    ValueError
        On missing, unknown or misshapen entries, each naming the key.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"sd: expected a mapping of str keys to tensors (a state dict), "
                        f"got {type(sd).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    for key in sd:
        if not isinstance(key, str):
            raise TypeError(f"sd: expected str keys (a state dict), got the key {key!r} "
                            f"({type(key).__name__})")
    own = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not own:
        raise ValueError(f"sd: no key starts with prefix {prefix!r}")
    expected = set(_reference_layout(1, 1, 1, None))  # every key (grid_cache optional)
    unknown = sorted(set(own) - expected)
    missing = sorted(expected - set(own) - {"grid_cache"})
    if unknown or missing:
        raise ValueError(f"sd: not a reference memory state dict under prefix {prefix!r}; "
                         f"unknown keys {unknown}, missing keys {missing}")
    for key, value in own.items():
        if not isinstance(value, Tensor) or not value.is_floating_point():
            got = f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__
            raise TypeError(f"{prefix}{key}: expected a floating torch.Tensor, got {got} "
                            f"(convert with torch.as_tensor first)")
    theirs = None if target is None else _target_state(target)
    if theirs is None:
        d, c, length = _reference_sizes(own, prefix)
        grid = None
    else:
        for name in ("out_proj.weight", "write_proj.weight"):
            if name not in theirs:
                raise ValueError(f"target: not a TensorMemory state dict (no {name})")
        d, c = (int(s) for s in theirs["out_proj.weight"].shape)
        length = int(theirs["write_proj.weight"].shape[1]) // d
        stored = theirs.get("_extra_state")
        grid = tuple(int(s) for s in stored.tolist()) \
            if isinstance(stored, Tensor) and stored.dim() == 1 else None
        if grid is not None and len(grid) != 3:
            raise ValueError(f"target: the reference is 3-D; the target's memory_shape is {grid}")
    sizes = f"d = {d}, C = {c}, L = {length}" + (" (the target's)" if theirs is not None
                                                  else " (from out_proj / write_proj)")
    for key, (shape, layout) in _reference_layout(d, c, length, grid).items():
        if key not in own:
            continue
        got = tuple(own[key].shape)
        if len(got) != len(shape) or any(w is not None and w != g for w, g in
                                         zip(shape, got, strict=False)) \
                or (key == "grid_cache" and min(got[2:], default=0) < 1):
            want = tuple("?" if w is None else w for w in shape)
            raise ValueError(f"{prefix}{key}: expected shape {layout} = {want} ({sizes}), "
                             f"got {got}")
    out = {new: own[old].detach() for old, new in _RENAMED.items()}
    out["cell.depthwise_weight"] = torch.stack(
        [own[f"{name}.weight"].detach().reshape(2 * c, 3) for name in _DEPTHWISE])
    out["cell.depthwise_bias"] = torch.stack([own[f"{name}.bias"].detach()
                                              for name in _DEPTHWISE])
    out["cell.pointwise_weight"] = own["gate_conv.pointwise.weight"].detach().reshape(
        4 * c, 2 * c)
    out["cell.pointwise_bias"] = own["gate_conv.pointwise.bias"].detach()
    if "grid_cache" in own:
        out["_extra_state"] = torch.tensor(tuple(own["grid_cache"].shape[2:]), dtype=torch.int32)
    if theirs is not None:
        source = {new: old for old, new in _RENAMED.items()}
        source.update({"cell.depthwise_weight": f"{_DEPTHWISE[0]}.weight",
                       "cell.depthwise_bias": f"{_DEPTHWISE[0]}.bias",
                       "cell.pointwise_weight": "gate_conv.pointwise.weight",
                       "cell.pointwise_bias": "gate_conv.pointwise.bias"})
        for name, value in out.items():
            want = theirs.get(name)
            if name == "_extra_state" or not isinstance(want, Tensor):
                continue
            if tuple(value.shape) != tuple(want.shape):
                raise ValueError(f"{prefix}{source[name]}: converts to {name} of shape "
                                 f"{tuple(value.shape)}, the target's is {tuple(want.shape)}")
            if value.dtype != want.dtype:
                raise TypeError(f"{prefix}{source[name]}: expected dtype {want.dtype} (the "
                                f"target's {name}), got {value.dtype} (cast the checkpoint "
                                f"first, or convert without target=)")
    return out


# --------------------------------------------------------------------------- a memory, its config


def memory_to_dict(module: TensorMemory) -> dict[str, Any]:
    """A :class:`TensorMemory` as plain data, for ``torch.save``.

    ``torch.load(..., weights_only=True)`` reads it back; :func:`memory_from_dict`
    rebuilds the module. The config is :meth:`tmcore.layer.LayerConfig.to_dict`'s, as a
    Hugging Face ``config.json`` and the JAX adapter's parameters carry it (JAX:
    ``params_from_state_dict(sd, config=LayerConfig.from_dict(data["config"]))``).

    Parameters
    ----------
    module : TensorMemory
        The memory.

    Returns
    -------
    dict
        ``{"config": dict, "state_dict": dict of Tensor}`` (tensors detached, not copied).

    Raises
    ------
    TypeError
        If ``module`` is not a :class:`TensorMemory`.
    """
    if not isinstance(module, TensorMemory):
        raise TypeError(f"module: expected a TensorMemory, got {type(module).__name__}")
    return {"config": module.config.to_dict(),
            "state_dict": {k: v.detach() for k, v in module.state_dict().items()}}


def memory_from_dict(data: Mapping[str, Any], *, device: Any = None, dtype: Any = None
                     ) -> TensorMemory:
    """Rebuild the :class:`TensorMemory` :func:`memory_to_dict` saved.

    The config is read with :meth:`tmcore.layer.LayerConfig.from_dict` (every field
    checked, and the parameters' bytes, before anything is allocated); the weights are
    loaded strictly.

    Parameters
    ----------
    data : dict
        What :func:`memory_to_dict` returned (e.g. after ``torch.load``).
    device, dtype : optional
        Where and in which dtype to build the module (default torch's).

    Returns
    -------
    TensorMemory
        The module, with the saved weights.

    Raises
    ------
    TypeError, ValueError
        If ``data`` is not that dict or its config is not a valid one (naming
        ``data['config'].<field>``).
    RuntimeError
        If the weights do not fit the config (``load_state_dict``'s error).
    MemoryError
        If the parameters would not fit the device.
    """
    if not isinstance(data, Mapping) or set(data) != {"config", "state_dict"}:
        keys = sorted(map(str, data)) if isinstance(data, Mapping) else None
        raise TypeError(f"data: expected the dict memory_to_dict made (keys config and "
                        f"state_dict), got {type(data).__name__} with keys {keys}")
    config = tl.LayerConfig.from_dict(data["config"], "data['config']")
    module = TensorMemory(**config.to_dict(), device=device, dtype=dtype)
    module.load_state_dict(data["state_dict"], strict=True)
    return module


# --------------------------------------------------------------------------- saving a stream

_STATE_FIELDS = tl.StreamState._fields


def state_to_dict(state: Any) -> dict[str, Any]:
    """Turn a stream state into a plain dict of tensors, for ``torch.save``.

    ``torch.load(..., weights_only=True)`` reads it back with nothing registered;
    :func:`state_from_dict` restores it. (Importing this module also registers
    :class:`StreamState` with ``torch.serialization.add_safe_globals``, so a saved
    ``StreamState`` itself loads with ``weights_only=True`` in a process that
    imported ``tmcore.adapters.torch``.)

    Parameters
    ----------
    state : StreamState or pair of Tensor
        A :class:`StreamState`, or an ``(h, c)`` pair.

    Returns
    -------
    dict
        ``{"h", "c" (B, C, *S), "pending" (B, L, d), "count" (B,) int64, "read"
        (B, C), "count_kind"}`` (``"count_kind"``: ``"tuple"`` or ``"tensor"``, the
        form ``count`` had), or ``{"h", "c"}`` for a pair. Tensors are detached,
        not copied.

    Raises
    ------
    TypeError
        If ``state`` is neither, or a field is not a tensor.
    """
    if isinstance(state, tl.StreamState):
        out = state._asdict()
        for name, value in out.items():
            if name != "count" and not isinstance(value, Tensor):
                raise TypeError(f"state.{name}: expected a torch.Tensor, "
                                f"got {type(value).__name__}")
        count, as_tensor = state.count, isinstance(state.count, Tensor)
        out["count"] = count.to(torch.int64) if as_tensor else torch.tensor(
            [int(k) for k in count], dtype=torch.int64)
        return {**{k: v.detach() for k, v in out.items()},
                "count_kind": "tensor" if as_tensor else "tuple"}
    if isinstance(state, (tuple, list)) and len(state) == 2 \
            and all(isinstance(s, Tensor) for s in state):
        return {"h": state[0].detach(), "c": state[1].detach()}
    raise TypeError(f"state: expected a StreamState or a pair (h, c) of tensors, "
                    f"got {type(state).__name__}")


def state_from_dict(data: Mapping[str, Any]) -> Any:
    """Restore the stream state :func:`state_to_dict` made.

    Parameters
    ----------
    data : dict
        What :func:`state_to_dict` returned (e.g. after ``torch.load``).

    Returns
    -------
    StreamState or tuple of Tensor
        A :class:`StreamState` (``count`` in the form it was saved in), or an
        ``(h, c)`` tuple.

    Raises
    ------
    TypeError
        If ``data`` is not a mapping or a field is not a tensor.
    ValueError
        If the keys, ``count`` or ``count_kind`` are not what
        :func:`state_to_dict` writes.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"data: expected the dict state_to_dict made, got {type(data).__name__}")
    keys = set(data)
    if keys == {"h", "c"}:
        return (data["h"], data["c"])
    wanted = set(_STATE_FIELDS) | {"count_kind"}
    if keys != wanted:
        raise ValueError(f"data: expected the keys {sorted(wanted)} (or just h and c), "
                         f"got {sorted(map(str, keys))}")
    for name in _STATE_FIELDS:
        if not isinstance(data[name], Tensor):
            raise TypeError(f"data[{name!r}]: expected a torch.Tensor, "
                            f"got {type(data[name]).__name__}")
    count, h = data["count"], data["h"]
    if count.dim() != 1 or count.dtype.is_floating_point or count.dtype == torch.bool:
        raise ValueError(f"data['count']: expected an integer tensor (B,), got "
                         f"{count.dtype} of shape {tuple(count.shape)}")
    if h.dim() < 3 or count.shape[0] != h.shape[0]:  # before reading any value
        raise ValueError(f"data['count']: expected one count per row of h (B = "
                         f"{h.shape[0] if h.dim() else None}), got shape {tuple(count.shape)}")
    pending = data["pending"]
    if pending.dim() != 3 or pending.shape[0] != h.shape[0]:
        raise ValueError(f"data['pending']: expected shape (B, L, d) with B = {h.shape[0]}, "
                         f"got {tuple(pending.shape)}")
    values = count.tolist()  # B values: checked for length above
    if not all(0 <= k < pending.shape[1] for k in values):
        raise ValueError(f"data['count']: expected {h.shape[0]} ints in [0, "
                         f"{pending.shape[1]}) (L from pending), got {values}")
    kind = data["count_kind"]
    if kind not in ("tuple", "tensor"):
        raise ValueError(f"data['count_kind']: expected 'tuple' or 'tensor', got {kind!r}")
    if kind == "tuple":
        count = tuple(int(k) for k in values)
    return tl.StreamState(data["h"], data["c"], data["pending"], count, data["read"])


# a StreamState (a NamedTuple of tensors and ints) saved whole loads with weights_only=True
torch.serialization.add_safe_globals([tl.StreamState])
