"""Shared pieces of the multi-GPU tests: the world size they will see, their marks (with the reason
they skip), and a check that fails on every rank when any rank fails (so no rank is left waiting in
the next collective)."""
from __future__ import annotations

import traceback

import pytest

from distnorm.launch import detect_launch_env, in_multiprocess_launch, launch_world_size


def multigpu_skip_reason() -> str | None:
    """Why the multi-GPU tests cannot run in this process (None when they can).

    Self-spawned: they need >= 2 visible GPUs. Under torchrun / mpirun: >= 2 ranks, and a GPU for
    every rank on this node (ranks sharing a GPU cannot map each other's memory as peers).
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not in_multiprocess_launch():
        return None if gpus >= 2 else f"needs >= 2 GPUs to self-spawn one process per GPU, torch sees {gpus}"
    env = detect_launch_env()
    if env.world_size < 2:
        return f"needs >= 2 ranks, {env.launcher} started {env.world_size}"
    if gpus < env.local_world_size:
        return (f"{env.launcher} started {env.local_world_size} ranks on this node, torch sees "
                f"{gpus} GPUs: needs one GPU per rank")
    return None


WORLD = launch_world_size()
SKIP_REASON = multigpu_skip_reason()
MULTIGPU_MARKS = [
    pytest.mark.multigpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
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
