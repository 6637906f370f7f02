"""Shared pieces of the multi-GPU tests: the world size they will see, their marks, and a check that
fails on every rank when any rank fails (so no rank is left waiting in the next collective)."""
from __future__ import annotations

import traceback

import pytest

from distnorm.launch import launch_world_size

WORLD = launch_world_size()
MULTIGPU_MARKS = [
    pytest.mark.multigpu,
    pytest.mark.skipif(WORLD < 2, reason=f"needs >= 2 GPUs / ranks, have {WORLD}"),
]
TIMEOUT_S = 300


def gathered_check(boot, check, *args):
    """Run check(*args) here, gather every rank's failure (with the tail of its traceback), and
    fail on all ranks if any failed. Returns check's result."""
    error = None
    result = None
    try:
        result = check(*args)
    except Exception as e:  # noqa: BLE001 - re-raised collectively below
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    failures = [f"rank {r}: {e}" for r, e in enumerate(boot.all_gather_object(error)) if e]
    assert not failures, "\n".join(failures)
    return result
