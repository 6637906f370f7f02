"""Seconds spent compiling kernels, per test: what decides how long the suite runs.

The kernels log one record per compile (``distnorm.compile``, with ``record.compile_s``); this
handler adds them to the test running at the time. Kernels compiled by processes a test starts
(a self-spawned rank pool) are not seen here.
"""
from __future__ import annotations

import logging
from collections import defaultdict


class CompileTally(logging.Handler):
    """Adds up ``record.compile_s`` per test node id (``current`` is set by the test hooks)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.current = "(outside tests)"
        self.seconds: dict[str, float] = defaultdict(float)
        self.kernels: dict[str, int] = defaultdict(int)

    def emit(self, record: logging.LogRecord) -> None:
        seconds = getattr(record, "compile_s", None)
        if seconds is not None:
            self.seconds[self.current] += seconds
            self.kernels[self.current] += 1

    def summary(self, top: int = 10) -> list[str]:
        """A line with the totals, then the ``top`` tests by compile seconds."""
        if not self.seconds:
            return []
        total, count = sum(self.seconds.values()), sum(self.kernels.values())
        lines = [f"distnorm compile time: {count} kernels in {total:.1f} s in this process; most:"]
        for node, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {seconds:6.1f} s  {self.kernels[node]:3d} kernels  {node}")
        return lines
