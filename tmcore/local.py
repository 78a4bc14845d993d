"""Deprecated path (removed in tmcore 0.3.0): the names now live in
tmcore.ops.window and tmcore.scan.local."""

from tmcore._moved import forward

__getattr__ = forward(__name__, "tmcore.ops.window", "tmcore.scan.local")
