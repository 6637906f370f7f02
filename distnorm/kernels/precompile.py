"""Compile many single-GPU kernels at once, in worker processes, into the on-disk kernel cache.

Compiling is single-threaded (CuTe DSL keeps its MLIR context per thread: compiling from threads
fails), about a second per kernel; N worker processes compile N at a time, and the calling process
then loads each kernel from the cache (kernels/disk_cache.py) in milliseconds. For an inference
server that knows its shapes at start-up, and for the test suite, which knows its grid.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

from distnorm.kernels import disk_cache

KIND = "FusedAddRMSNormQuant"  # compile_tvm_ffi's cache kind for compiled_fused_norm


def _compile(key: tuple) -> None:
    from distnorm.kernels.compile import compiled_fused_norm

    compiled_fused_norm(*key)


def precompile_fused_norm(keys: Iterable[tuple], workers: int | None = None) -> int:
    """Compile the kernels of ``keys`` (compiled_fused_norm's arguments, e.g. from
    ``distnorm.ops.fused_kernel_key``) that the cache lacks, ``workers`` at a time (default: half
    the CPUs, at most 8). Returns how many it compiled; 0 with the cache off (nothing to keep them)."""
    if disk_cache.cache_dir() is None:
        return 0
    missing = [key for key in dict.fromkeys(keys) if not disk_cache.kernel_path(KIND, key).exists()]
    if not missing:
        return 0
    if workers is None:
        workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    workers = max(1, min(workers, len(missing)))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for _ in pool.map(_compile, missing):
            pass
    return len(missing)
