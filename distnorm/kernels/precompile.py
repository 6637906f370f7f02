"""Compile many kernels at once, in worker processes, into the on-disk kernel cache.

Compiling is single-threaded (CuTe DSL keeps its MLIR context per thread: compiling from threads
fails), about a second per kernel; N worker processes compile N at a time, and the calling process
then loads each kernel from the cache (kernels/disk_cache.py) in milliseconds. For an inference
server that knows its shapes at start-up, and for the test suite, which knows its grid.

A key names its kernel: ("fused_norm", *compiled_fused_norm's arguments) from
``distnorm.ops.fused_kernel_key``, or ("allreduce", *compiled_allreduce's arguments) from
``distnorm.collectives.dispatch.allreduce_kernel_key``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from distnorm.kernels import disk_cache

FAMILIES = ("fused_norm", "allreduce")


def _builder(family: str):
    if family == "fused_norm":
        from distnorm.kernels.compile import compiled_fused_norm
        return compiled_fused_norm
    if family == "allreduce":
        from distnorm.kernels.compile_allreduce import compiled_allreduce
        return compiled_allreduce
    raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")


def _failed_marker(path: Path) -> Path:
    return path.with_name(path.name + ".failed")


def _compile(key: tuple) -> bool:
    """Compile one kernel into the cache. A kernel that fails to compile leaves a marker (so the
    processes waiting for it stop waiting) and is compiled again, failing loudly, where it is used."""
    path = cached_path(key)
    try:
        _builder(key[0])(*key[1:])
    except Exception as e:  # noqa: BLE001 - reported where the kernel is used
        path.parent.mkdir(parents=True, exist_ok=True)
        _failed_marker(path).write_text(f"{type(e).__name__}: {e}\n")
        return False
    _failed_marker(path).unlink(missing_ok=True)
    return True


def cached_path(key: tuple) -> Path:
    """Where the cache keeps the kernel of ``key`` (the cache must be on)."""
    path = _builder(key[0]).cache_path(*key[1:])
    if path is None:
        raise RuntimeError("the kernel cache is off (DISTNORM_KERNEL_CACHE=0)")
    return path


def precompile(keys: Iterable[tuple], workers: int | None = None) -> int:
    """Compile the kernels of ``keys`` that the cache lacks, ``workers`` at a time (default: half
    the CPUs, at most 8). Returns how many it compiled (a kernel that fails is left to the call
    that uses it); 0 with the cache off (nothing keeps them)."""
    if disk_cache.cache_dir() is None:
        return 0
    missing = [key for key in dict.fromkeys(keys) if not cached_path(key).exists()]
    if not missing:
        return 0
    if workers is None:
        workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    workers = max(1, min(workers, len(missing)))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return sum(pool.map(_compile, missing))


def wait_for(keys: Sequence[tuple], timeout_s: float) -> bool:
    """Wait until every key's kernel is in the cache or failed to compile (other processes
    compiling them); False on timeout (the callers then compile what is missing themselves)."""
    deadline = time.monotonic() + timeout_s

    def settled(key: tuple) -> bool:
        path = cached_path(key)
        return path.exists() or _failed_marker(path).exists()

    while not all(settled(key) for key in keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
