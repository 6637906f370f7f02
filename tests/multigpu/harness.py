"""Shared pieces of the multi-GPU tests: the world size they will see, their marks (with the reason
they skip), and a check that fails on every rank when any rank fails (so no rank is left waiting in
the next collective)."""
from __future__ import annotations

import traceback

import pytest

from distnorm.launch import detect_launch_env, in_multiprocess_launch, launch_world_size
from distnorm.launch.env import gpu_sharing_requested

# Opt-in: ranks may share GPUs (under torchrun / mpirun: more ranks than GPUs; self-spawned on one
# GPU: 2 ranks, distnorm.launch.launch_world_size). The kernels then run correctly but time-sliced
# (no timings mean anything), torch.distributed uses gloo (NCCL refuses two ranks on one GPU), and
# peers on the same GPU map each other's memory as on two. docs/TESTING.md says what it checks.
SHARE_GPUS = gpu_sharing_requested()


def multigpu_skip_reason() -> str | None:
    """Why the multi-GPU tests cannot run in this process (None when they can).

    Self-spawned: they need >= 2 visible GPUs (or 1 with DISTNORM_SHARE_GPUS=1). Under torchrun /
    mpirun: >= 2 ranks, and a GPU for every rank on this node (with DISTNORM_SHARE_GPUS=1 one GPU
    for all). Sharing is a check of correctness only.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not in_multiprocess_launch():
        if gpus >= 2 or (SHARE_GPUS and gpus == 1):
            return None
        return (f"needs >= 2 GPUs to self-spawn one process per GPU (or 1 with "
                f"DISTNORM_SHARE_GPUS=1), torch sees {gpus}")
    env = detect_launch_env()
    if env.world_size < 2:
        return f"needs >= 2 ranks, {env.launcher} started {env.world_size}"
    if SHARE_GPUS and gpus >= 1:
        return None
    if gpus < env.local_world_size:
        return (f"{env.launcher} started {env.local_world_size} ranks on this node, torch sees "
                f"{gpus} GPUs: needs one GPU per rank (or DISTNORM_SHARE_GPUS=1 and >= 1 GPU: "
                "ranks share it, a check of correctness only)")
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


def all_gather_tensors(t, group=None) -> list:
    """Every rank's ``t`` (same shape and dtype on all ranks), on ``t``'s device, indexed by rank.

    Through the CPU when the group is gloo (ranks sharing a GPU): gloo's CUDA collectives are
    not what these tests check."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo" and t.is_cuda:
        parts = [torch.empty_like(t, device="cpu") for _ in range(world)]
        dist.all_gather(parts, t.contiguous().cpu(), group=group)
        return [p.to(t.device) for p in parts]
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class Expectations:
    """Checks that record a failure instead of raising it, for check functions that keep calling
    collectives after a check: a rank whose check failed still makes every call the others make
    (a raise would leave them in a collective this rank never enters). ``raise_any()`` at the end.
    """

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, message: str) -> None:
        if not ok:
            self.failures.append(message)

    def raise_any(self) -> None:
        more = f" (and {len(self.failures) - 10} more)" if len(self.failures) > 10 else ""
        assert not self.failures, "; ".join(self.failures[:10]) + more
