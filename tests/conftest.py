"""Shared pytest setup: import distnorm from this checkout; keep NVLink multicast off everywhere.

Multi-GPU tests (tests/multigpu) run their bodies through distnorm.launch.run_distributed: directly
on each rank under torchrun / mpirun, else in one self-spawned process per visible GPU.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from distnorm.launch.env import apply_no_multicast_env  # noqa: E402

apply_no_multicast_env()
