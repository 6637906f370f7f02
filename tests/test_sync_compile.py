"""The cross-rank barrier (distnorm.kernels.sync) and its test kernel compile for sm_90a from fake
tensors, no GPU needed (CuTe DSL 4.8+ with CUTE_DSL_ARCH set; 4.3.5 stops at a driver check and the
test skips, saying why). The compile runs in a subprocess: the DSL reads CUTE_DSL_ARCH once."""
from __future__ import annotations

import pytest

from cute_compile import compile_in_subprocess

BODY = """
from distnorm.kernels.barrier_test_kernel import compiled_barrier_rounds, compiled_primitives_smoke
for world in (2, 4, 8):
    for barrier_only in (False, True):
        compiled_barrier_rounds(world, barrier_only)
        done.append((world, barrier_only))
compiled_primitives_smoke()
done.append("v4")
"""


def test_barrier_kernels_compile_sm90a():
    assert compile_in_subprocess(BODY, timeout=300) == 7


def test_region_layout_and_timeout(monkeypatch):
    pytest.importorskip("cutlass")
    from distnorm.kernels import sync

    assert sync.BARRIER_REGION_WORDS == sync.MAX_CTAS * (1 + sync.MAX_WORLD)
    assert sync.region_word(2) == 2 * sync.BARRIER_REGION_WORDS
    monkeypatch.delenv(sync.TIMEOUT_ENV, raising=False)
    assert sync.timeout_ns() == int(sync.DEFAULT_TIMEOUT_S * 1e9)
    monkeypatch.setenv(sync.TIMEOUT_ENV, "2.5")
    assert sync.timeout_ns() == 2_500_000_000
    assert sync.timeout_ns(1) == 1_000_000_000
    with pytest.raises(ValueError):
        sync.timeout_ns(0)
