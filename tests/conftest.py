"""Shared pytest setup: import distnorm from this checkout; keep NVLink multicast off everywhere.

Multi-GPU tests (tests/multigpu) run their bodies through distnorm.launch.run_distributed: directly
on each rank under torchrun / mpirun, else in one self-spawned process per visible GPU.
"""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _path in (_TESTS, _ROOT):  # tests/: helper modules (barrier_kernel, harness, ...) import by name
    if _path not in sys.path:
        sys.path.insert(0, _path)

from distnorm.launch.env import apply_no_multicast_env  # noqa: E402

apply_no_multicast_env()
