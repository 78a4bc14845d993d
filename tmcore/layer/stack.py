"""Multi-layer memory: the modes :data:`MODES` and where each layer of a stack starts.

``"causal"``: every layer scans from its own state at the start of the segment;
``"threaded"`` (the reference): layer ``l`` starts from the state layer ``l - 1``
reached after the whole segment (not causal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tmcore.layer.state import State, StreamState

__all__ = ["MODES", "check_mode", "final_state", "segment_states", "start_state"]

#: The multi-layer modes (see the module docstring).
MODES = ("causal", "threaded")


def check_mode(mode: Any) -> str:
    """Check a multi-layer mode.

    Parameters
    ----------
    mode : str
        One of :data:`MODES`.

    Returns
    -------
    str
        ``mode`` (a ``ValueError`` naming it if it is not one of :data:`MODES`).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def _is_pair(state: Any) -> bool:
    """One layer's state: an ``(h, c)`` pair or a :class:`StreamState`."""
    if isinstance(state, StreamState):
        return True
    return (isinstance(state, (tuple, list)) and len(state) == 2
            and all(hasattr(s, "shape") for s in state))


def segment_states(mode: str, state: Any, layers: int) -> Any:
    """The state a stack of ``layers`` starts a segment from, normalized.

    Parameters
    ----------
    mode : {"causal", "threaded"}
        The stack's mode.
    state : None, a state or a sequence of states
        ``None``, one layer's state (an ``(h, c)`` pair or a :class:`StreamState`) or
        one per layer.
    layers : int
        The number of layers.

    Returns
    -------
    list or state or None
        Causal: one state per layer (``None``: zeros; one given state serves every
        layer; a ``ValueError`` if a sequence holds another number). Threaded: one
        state or ``None`` (a per-layer sequence gives its last layer's).
    """
    check_mode(mode)
    if mode == "threaded":
        if state is None or _is_pair(state):
            return state
        states = list(state)
        return states[-1] if states else None
    if state is None or _is_pair(state):
        return [state] * layers
    states = list(state)
    if len(states) != layers:
        raise ValueError(f"state: expected {layers} per-layer (h, c) pairs in causal mode, "
                         f"got {len(states)}")
    return states


def start_state(mode: str, layer: int, segment: Any, previous: State | None) -> tuple[Any, bool]:
    """Where layer ``layer`` of a stack starts.

    Causal: its own segment state; threaded: layer 0 the segment state, every later one
    the previous layer's final state.

    Parameters
    ----------
    mode : {"causal", "threaded"}
        The stack's mode.
    layer : int
        The layer's index.
    segment : list or state or None
        :func:`segment_states`' result.
    previous : pair of arrays or None
        The state layer ``layer - 1`` reached in this segment.

    Returns
    -------
    state : state or None
        Where the layer starts (``None``: zeros).
    reset : bool
        Whether the call's reset mask applies to it (not to a state reset upstream).
    """
    if mode == "causal":
        return segment[layer], True
    if layer == 0:
        return segment, True
    return previous, False


def final_state(mode: str, finals: Sequence[State]) -> Any:
    """The state a stack returns.

    Parameters
    ----------
    mode : {"causal", "threaded"}
        The stack's mode.
    finals : sequence of states
        Each layer's state at the end of the segment, first layer first.

    Returns
    -------
    tuple of states or state
        Causal: all of them; threaded: the last one.
    """
    return tuple(finals) if mode == "causal" else finals[-1]
