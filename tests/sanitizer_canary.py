"""A kernel that writes where nothing is mapped, to show that a compute-sanitizer run sees the
project's kernels at all: run under `compute-sanitizer --tool memcheck`, each mode must report an
invalid global write (an error count above 0), else a clean memcheck run of the real kernels says
nothing. "st" writes with thread stores, "tma" with cp.async.bulk stores from shared memory (the
reduce-scatter's TMA forms push that way: whether memcheck checks bulk copies is what this shows).

    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sanitizer_canary.py st
    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sanitizer_canary.py tma

Exits 0 after the launch; without a sanitizer the launch faults (illegal address).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

UNMAPPED_OFFSET = 1 << 40  # bytes past a fresh allocation: no allocation of this process is there


def main(mode: str) -> None:
    from push_kernel import CHUNK, compiled_push

    src = torch.randn(CHUNK // 4, device="cuda")
    dst = torch.empty(CHUNK // 4, device="cuda")
    anchor = torch.zeros(1, dtype=torch.int32, device="cuda")
    compiled_push(mode)(src.data_ptr(), dst.data_ptr() + UNMAPPED_OFFSET, CHUNK, 1, anchor)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # the fault itself, when no sanitizer stops the write
        print(f"canary {mode}: the launch faulted: {str(e)[:120]}")
        return
    print(f"canary {mode}: launched")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("st", "tma"):
        sys.exit("usage: sanitizer_canary.py st|tma")
    main(sys.argv[1])
