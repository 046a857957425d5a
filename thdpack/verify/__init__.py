"""``thdpack verify`` and the exactness harness behind it: a packed, CP-sharded, DP-split,
gradient-accumulated training step against the same step on every sequence alone."""

from __future__ import annotations

from thdpack.verify.command import run_verify

__all__ = ["run_verify"]
