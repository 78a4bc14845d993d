"""The gated memory residual (:func:`residual_init` / :func:`residual_apply`) and the
multi-layer :func:`stack_apply` (modes ``"causal"`` and ``"threaded"``) of the JAX
adapter, over :func:`tmcore.adapters.jax.functional.apply`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tmcore import layer as tl
from tmcore.adapters.jax.functional import MemoryState, _run, init
from tmcore.runtime.validate import check_finite

__all__ = ["residual_apply", "residual_init", "stack_apply"]


def residual_init(key: jax.Array, embed_dim: int, memory_channels: int,
                  memory_shape: Sequence[int], chunk_size: int, sigma_scale: float = 1.0, *,
                  gate_init: float = 0.0, dtype: Any = jnp.float32, **options: Any) -> dict:
    """Parameters of the gated residual ``x + sigmoid(gate) * memory(norm(x))``.

    The memory's parameters are :func:`init`'s with the same key and options, so
    with the same key they equal :class:`MemoryResidual`'s (``nnx.Rngs(seed)``'s
    first ``params`` key) for every option.

    Parameters
    ----------
    key : jax.Array
        A ``jax.random`` key.
    embed_dim, memory_channels, memory_shape, chunk_size : int, int, sequence of int, int
        The sizes ``d``, ``C``, ``S`` and ``L``, as in :func:`init`.
    sigma_scale : float, default 1.0
        Multiplies the write spread.
    gate_init : float, default 0.0
        The gate's initial value: 0.0 (half open) and -2.0 (mostly closed) are
        the paper's two choices.
    dtype : dtype, default float32
        The parameters' dtype.
    **options
        The layer's other keywords, as in :func:`init`.

    Returns
    -------
    dict
        ``{"norm": {"weight" (d,), "bias" (d,)}, "memory": init(...), "gate"
        (1,)}``; ``norm`` is a LayerNorm (ones, zeros, eps 1e-5 as in torch).

    Raises
    ------
    TypeError, ValueError
        As :func:`init` raises them; ``ValueError`` for a non-finite ``gate_init``.
    """
    memory = init(key, embed_dim, memory_channels, memory_shape, chunk_size, sigma_scale,
                  dtype=dtype, **options)
    norm, gate = _norm_and_gate(memory["out_proj"]["bias"].shape[0], gate_init, dtype)
    return {"norm": norm, "memory": memory, "gate": gate}


def _norm_and_gate(d: int, gate_init: float, dtype: Any) -> tuple[dict, jax.Array]:
    """The residual's LayerNorm ``{"weight": ones (d,), "bias": zeros (d,)}`` and its gate
    ``(1,)`` of ``gate_init`` (checked finite); :class:`MemoryResidual` makes them too."""
    return ({"weight": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)},
            jnp.full(tl.GATE_SHAPE, check_finite("gate_init", gate_init), dtype))


def residual_apply(
    params: Mapping[str, Any], x: jax.Array, state: Any = None, **kwargs: Any
) -> tuple[jax.Array, MemoryState]:
    """The gated residual ``x + sigmoid(gate) * apply(memory, layer_norm(x), state)``.

    One compiled call, as :func:`apply` (the norm and the gate inside it).

    Parameters
    ----------
    params : dict
        From :func:`residual_init` (or :func:`params_from_state_dict` of a
        torch ``MemoryResidual``).
    x : jax.Array, shape ``(B, N, d)``
        The tokens.
    state : StreamState, MemoryState or None, optional
        As in :func:`apply`.
    **kwargs
        :func:`apply`'s keywords (``reset``, ``stream``, ``doc_starts``, ...).

    Returns
    -------
    out : jax.Array, shape ``(B, N, d)``
        ``x`` plus the gated memory read.
    state : StreamState or MemoryState
        The memory's final state, as :func:`apply` returns it.

    Raises
    ------
    KeyError
        If ``params`` lacks ``norm``, ``memory`` or ``gate`` or a memory parameter.
    TypeError, ValueError
        As :func:`apply` raises them.
    """
    return _run(params["memory"], x, state, (params["norm"], params["gate"]), **kwargs)


def stack_apply(
    layers: Sequence[Mapping[str, Any]],
    x: jax.Array,  # [B, N, d]
    state: Any = None,
    *,
    mode: str,
    blocks: Sequence[Callable[[jax.Array], jax.Array]] | None = None,
    reset: jax.Array | None = None,
    **kwargs: Any,
) -> tuple[jax.Array, Any]:
    """A stack of gated memory residuals, optionally after per-layer blocks.

    Layer ``l`` computes ``x = blocks[l](x)`` (when given), then
    ``x = residual_apply(layers[l], x, ...)``. Repeat one parameter pytree in
    ``layers`` to share a memory between blocks.

    Parameters
    ----------
    layers : sequence of dict
        One :func:`residual_init` pytree per layer.
    x : jax.Array, shape ``(B, N, d)``
        The tokens.
    state : MemoryState, tuple of states or None, optional
        ``"threaded"``: one :class:`MemoryState`; ``"causal"``: a tuple of
        per-layer states (a single state is used for every layer); ``None``:
        zeros.
    mode : {"threaded", "causal"}
        ``"threaded"`` (the paper's): one state threaded through the layers --
        layer ``l`` starts from the state layer ``l - 1`` reached after the
        WHOLE segment, so every position sees later tokens of the segment. Not
        causal; right for bidirectional inputs (images, clip classification).
        ``"causal"``: every layer scans from its own state at the start of the
        segment, so a read at chunk ``t`` depends only on earlier chunks and
        chunk ``t``'s first token. Right for language modelling; streaming is
        exact (:mod:`tmcore.layer`).
    blocks : sequence of callable, optional
        ``blocks[l](x) -> x``, run before memory layer ``l``; one per layer.
    reset : jax.Array of bool, shape ``(B,)``, optional
        Zeroes the incoming state of the flagged sequences (every layer's).
    **kwargs
        :func:`apply`'s keywords (``stream``, ``doc_starts``, ...).

    Returns
    -------
    out : jax.Array, shape ``(B, N, d)``
        The last layer's output.
    state : MemoryState or tuple
        ``"threaded"``: the last layer's :class:`MemoryState`; ``"causal"``: a
        tuple of per-layer states (:class:`StreamState` by default).

    Raises
    ------
    ValueError
        If ``mode`` is unknown, ``blocks`` has not one callable per layer,
        ``"threaded"`` is asked to stream (``stream``, ``doc_starts``,
        ``valid``), or the state has not one entry per layer; else as
        :func:`apply` raises.
    """
    tl.check_mode(mode)
    if mode == "threaded":
        if kwargs.get("stream") or kwargs.get("doc_starts") is not None \
                or kwargs.get("valid") is not None:
            raise ValueError("stream / doc_starts / valid: streaming across chunk "
                             "boundaries, packed documents and skipped tokens need "
                             "mode='causal'")
        kwargs["stream"] = False
    if blocks is not None and len(blocks) != len(layers):
        raise ValueError(f"blocks: expected {len(layers)} callables (one per layer), "
                         f"got {len(blocks)}")
    segment = tl.segment_states(mode, state, len(layers))
    finals: list[MemoryState] = []
    previous = None
    for index, params in enumerate(layers):
        x = x if blocks is None else blocks[index](x)
        start, resets = tl.start_state(mode, index, segment, previous)
        x, previous = residual_apply(params, x, start, reset=reset if resets else None,
                                     **kwargs)
        finals.append(previous)
    return x, tl.final_state(mode, finals)

