"""Deprecated path (removed in tmcore 0.3.0): the names now live in
tmcore.scan.options and tmcore.scan.warped."""

from tmcore._moved import forward

__getattr__ = forward(__name__, "tmcore.scan.options", "tmcore.scan.warped")
