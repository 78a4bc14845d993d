"""The layer's hyperparameters: :class:`LayerConfig`, checked once by :func:`layer_config`.

Sizes: ``d`` = embed_dim, ``C`` = memory_channels, ``S`` = memory_shape (``n = len(S)``,
1 to 4 axes), ``L`` = chunk_size. Sizes are ints >= 1, Python or NumPy (a float, a bool
or a string where an int belongs is a ``TypeError``, a bad value a ``ValueError``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import array_api_compat

from tmcore.ops.splat import DEFAULT_EPS
from tmcore.runtime import validate
from tmcore.runtime.validate import (
    check_eps,
    check_finite,
    check_flag,
    check_grid_shape,
    check_int,
    check_positive_scalar,
    check_radius,
)

__all__ = ["DYNAMICS", "UPDATES", "LayerConfig", "layer_config"]


def _size(name: str, value: Any) -> int:
    """A positive int (Python or NumPy, never bool or float)."""
    return check_int(name, value, 1)


def _grid(value: Any) -> tuple[int, ...]:
    """``memory_shape``: a sequence of 1 to 4 positive ints (a bare int is refused: ``4``
    could mean ``(4,)`` or ``(4, 4, 4)``)."""
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        raise TypeError(f"memory_shape: expected a sequence of 1 to 4 ints, e.g. ({value},) "
                        f"for a 1-D grid or ({value}, {value}, {value}) for a 3-D one, got "
                        f"the bare int {value!r}")
    return check_grid_shape("memory_shape", value)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The layer's hyperparameters, validated (build with :func:`layer_config`).

    Parameters
    ----------
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, tuple of int, int
        The sizes ``d``, ``C``, ``S`` and ``L``.
    sigma_scale, checkpoint_every, radius, eps, forget_bias, zero_init : see layer_config
        The write spread's scale, the backward's checkpoint interval, the splat's
        truncation and offset, the initial forget-gate bias and the zero read-out,
        as :func:`layer_config` checks them.
    update, window, dynamics, flow : see layer_config
        The experimental options beyond the paper.
    """

    embed_dim: int
    memory_channels: int
    memory_shape: tuple[int, ...]
    chunk_size: int
    sigma_scale: float = 1.0
    checkpoint_every: int = 1
    radius: float | None = None
    eps: float = DEFAULT_EPS
    forget_bias: float = 0.0
    zero_init: bool = False
    #: ``"dense"`` (the paper's step) or ``"local"`` (write and update only a window of
    #: ``window`` cells per axis around the write, :mod:`tmcore.scan.local`; experimental)
    update: str = "dense"
    window: int | None = None
    #: ``"none"`` or ``"warp"`` (the state is resampled at the cell centres plus a
    #: per-chunk shift predicted by ``warp_net`` before each update,
    #: :mod:`tmcore.scan.warped`; experimental)
    dynamics: str = "none"
    #: with ``dynamics="warp"``: add a per-cell flow ``(B, n, *S)`` from a factorized
    #: depthwise conv of ``h`` (group ``warp_flow``, zero at init) to the shift
    flow: bool = False

    @property
    def ndim(self) -> int:
        """``n``, the number of spatial axes."""
        return len(self.memory_shape)

    def to_dict(self) -> dict[str, Any]:
        """Give every field as a JSON-ready value (``memory_shape`` a list).

        What a Hugging Face config, a JAX parameter file or a checkpoint stores
        (:meth:`from_dict` reads it back).

        Returns
        -------
        dict
            ``{field: value}`` for every field, in declaration order.
        """
        out = dataclasses.asdict(self)
        out["memory_shape"] = list(self.memory_shape)
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "config") -> LayerConfig:
        """Read back the config :meth:`to_dict` stored, checked as :func:`layer_config`.

        Parameters
        ----------
        data : dict
            ``{field: value}``.
        where : str, default "config"
            What ``data`` is, for the messages (e.g. ``"tensor_memory"``).

        Returns
        -------
        LayerConfig
            The validated config.

        Raises
        ------
        TypeError
            If ``data`` is not a dict or a value has the wrong kind; the message names
            ``where.field``.
        ValueError
            If a field is missing or unknown, or a value is out of range.
        """
        if not isinstance(data, dict):
            raise TypeError(f"{where}: expected a dict, got {type(data).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = [k for k in fields if k not in data]
        unknown = sorted(set(data) - set(fields))
        if missing or unknown:
            raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}")
        try:
            return layer_config(**data)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}.{error}") from error

    def replace(self, **changes: Any) -> LayerConfig:
        """This config with ``changes``, checked as :func:`layer_config` checks them.

        Parameters
        ----------
        **changes
            Fields and their new values (e.g. ``checkpoint_every=4``).

        Returns
        -------
        LayerConfig
            The new config.
        """
        return layer_config(**{**self.to_dict(), **changes})

    def state_shape(self, batch: int) -> tuple[int, ...]:
        """The shape of ``h`` (and ``c``) for a batch.

        Parameters
        ----------
        batch : int
            ``B``.

        Returns
        -------
        tuple of int
            ``(B, C, *S)``.
        """
        return (batch, self.memory_channels, *self.memory_shape)


def layer_config(
    embed_dim: Any, memory_channels: Any, memory_shape: Any, chunk_size: Any,
    sigma_scale: Any = 1.0, *, checkpoint_every: Any = 1, radius: Any = None,
    eps: Any = DEFAULT_EPS, forget_bias: Any = 0.0, zero_init: Any = False,
    update: Any = "dense", window: Any = None, dynamics: Any = "none", flow: Any = False,
) -> LayerConfig:
    """Validate the layer's arguments once; returns a frozen :class:`LayerConfig`.

    Sizes are ints >= 1, Python or NumPy (bool and float are a ``TypeError``,
    < 1 a ``ValueError``).

    Parameters
    ----------
    embed_dim : int
        ``d``, the width of the tokens.
    memory_channels : int
        ``C``, the channels of the state.
    memory_shape : sequence of int
        ``S``, the grid: 1 to 4 sizes (a bare int is a ``TypeError``: ``4``
        could mean ``(4,)`` or ``(4, 4, 4)``).
    chunk_size : int
        ``L``, the tokens per chunk (one read and one write each).
    sigma_scale : float, default 1.0
        A finite number > 0 multiplying every write spread.
    checkpoint_every : int, default 1
        The backward keeps the state entering every ``checkpoint_every``-th
        chunk and replays the rest.
    radius : float or None, default None
        The splat's truncation radius in sigmas (> 0; ``None``: no truncation).
    eps : float, default 1e-6
        A finite number >= 0 added to the splat's ``2 sigma^2``.
    forget_bias : float, default 0.0
        The initial bias of the forget gate (a finite number).
    zero_init : bool, default False
        The read-out ``out_proj`` starts at zero (weight and bias), so the
        layer's output is exactly 0 at initialization while ``out_proj`` still
        gets a gradient (an attached memory is then an exact identity that
        trains).
    update : {"dense", "local"}, default "dense"
        Experimental (docs/guides/local-and-warp.md): ``"local"`` writes and
        updates only a window of cells around the write.
    window : int or None, default None
        With ``update="local"`` (and only then), the window's cells per axis:
        an int in ``[1, max(memory_shape)]`` (the whole axis on a shorter one).
    dynamics : {"none", "warp"}, default "none"
        Experimental: ``"warp"`` resamples the state by a per-chunk shift
        before each update and adds the zero-initialized ``warp_net`` group.
    flow : bool, default False
        With ``dynamics="warp"`` (and only then): add a per-cell flow, a
        factorized depthwise conv of ``h`` to ``n`` components (group
        ``warp_flow``, zero pointwise map at init), to the shift.

    Returns
    -------
    LayerConfig
        The validated hyperparameters (frozen, hashable).

    Raises
    ------
    TypeError
        If an argument has the wrong kind of value (a float, a bool or a string
        where an int belongs; a non-string ``update`` or ``dynamics``; an array
        ``sigma_scale``); each error names the argument.
    ValueError
        If a value is out of range, ``update`` or ``dynamics`` is not one of its
        options, ``window`` is missing with ``"local"`` or given with
        ``"dense"``, or the state or ``write_proj`` would have more elements
        than int64 indexes.
    """
    check_positive_scalar("sigma_scale", sigma_scale)
    if array_api_compat.is_array_api_obj(sigma_scale):
        raise TypeError(f"sigma_scale: expected a finite number > 0, got an array "
                        f"{type(sigma_scale).__name__}")
    return _check_sizes(LayerConfig(
        embed_dim=_size("embed_dim", embed_dim),
        memory_channels=_size("memory_channels", memory_channels),
        memory_shape=_grid(memory_shape),
        chunk_size=_size("chunk_size", chunk_size),
        sigma_scale=float(sigma_scale),
        checkpoint_every=_size("checkpoint_every", checkpoint_every),
        radius=check_radius(radius),
        eps=check_eps(eps),
        forget_bias=check_finite("forget_bias", forget_bias),
        zero_init=check_flag("zero_init", zero_init),
        update=_choice("update", update, UPDATES),
        window=_window(update, window, memory_shape),
        dynamics=_choice("dynamics", dynamics, DYNAMICS),
        flow=_flow(flow, dynamics),
    ))


def _check_sizes(config: LayerConfig) -> LayerConfig:
    """``config`` if one row of its state ``(C, *S)`` and ``write_proj (d, L*d)`` have
    int64-addressable sizes (else a ``ValueError`` naming the argument)."""
    validate.check_count("memory_shape", (config.memory_channels, *config.memory_shape),
                      "(C, *S)", "the state of one sequence")
    validate.check_count("embed_dim", (config.embed_dim, config.chunk_size * config.embed_dim),
                      "(d, L*d)", "write_proj.weight")
    return config


def _flow(flow: Any, dynamics: Any) -> bool:
    """``flow``: a bool, True only with ``dynamics="warp"``."""
    if check_flag("flow", flow) and dynamics != "warp":
        raise ValueError(f"flow: a per-cell flow needs dynamics='warp', got "
                         f"dynamics={dynamics!r}")
    return bool(flow)


#: The ``update`` options of :func:`layer_config`.
UPDATES = ("dense", "local")
#: The ``dynamics`` options of :func:`layer_config`.
DYNAMICS = ("none", "warp")


def _choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """One of ``options`` (a non-string is a ``TypeError``, another string a ``ValueError``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {options}, got {value!r}")
    if value not in options:
        raise ValueError(f"{name}: expected one of {options}, got {value!r}")
    return value


def _window(update: Any, window: Any, memory_shape: Any) -> int | None:
    """``window``: ``None`` unless ``update="local"``, then an int in ``[1, max(S)]``."""
    if update != "local":
        if window is not None:
            raise ValueError(f"window: only used with update='local', got window={window!r} "
                             f"with update={update!r}")
        return None
    if window is None:
        raise ValueError("window: update='local' needs window, the cells per axis of the "
                         "updated window (an int >= 1)")
    return check_int("window", window, 1, max(_grid(memory_shape)))
