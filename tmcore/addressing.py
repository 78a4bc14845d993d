"""Deprecated path (removed in tmcore 0.3.0): the names now live in
tmcore.ops.addressing."""

from tmcore._moved import forward

__getattr__ = forward(__name__, "tmcore.ops.addressing")
