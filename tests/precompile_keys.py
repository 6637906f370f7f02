"""The kernels the selected tests compile, compiled ahead in worker processes (tests/conftest.py).

A test module may define ``kernel_keys(test, params) -> list`` (distnorm.kernels.precompile keys)
for its costly tests. Per-process tests' keys are compiled by the process that runs them; the
multi-GPU tests' keys are the same on every rank, so under a launcher rank r compiles every
world-th of them and then waits for the others' (files appearing in the cache).
"""
from __future__ import annotations

import time

#: How long a rank waits for the others' share of the multi-GPU tests' kernels.
WAIT_S = 600.0


def keys_of(items) -> tuple[list, list]:
    """(per-process keys, multi-GPU keys) of the selected items."""
    per_process, collective = [], []
    for item in items:
        kernel_keys = getattr(getattr(item, "module", None), "kernel_keys", None)
        if kernel_keys is None:
            continue
        callspec = getattr(item, "callspec", None)
        keys = kernel_keys(item.originalname, callspec.params if callspec else {})
        (collective if item.get_closest_marker("multigpu") else per_process).extend(keys)
    return per_process, collective


def precompile_for(items, env) -> str:
    """Compile the items' kernels the cache lacks; a line for the terminal ("" when none)."""
    from distnorm.kernels.disk_cache import cache_dir
    from distnorm.kernels.precompile import precompile, wait_for

    if cache_dir() is None:
        return ""
    per_process, collective = keys_of(items)
    # a key its builder refuses (a test's list out of date with a builder's arguments) is left to
    # the call that uses it, and named: raised here it failed every rank's collection; dropped the
    # same way on every rank, so the ranks' shares of the multi-GPU keys still agree
    refused = [key for key in dict.fromkeys(per_process + collective) if not _nameable(key)]
    per_process = [key for key in per_process if key not in refused]
    collective = [key for key in dict.fromkeys(collective) if key not in refused]
    share = collective[env.rank::env.world_size] if env.is_multiprocess else collective
    start = time.perf_counter()
    compiled = precompile(per_process + share)
    waited = wait_for(collective, WAIT_S) if env.is_multiprocess else True
    note = (f"distnorm: {len(refused)} kernel keys refused by their builders, compiled where used "
            f"(first: {refused[0]!r})" if refused else "")
    if not compiled and waited:
        return note
    return "\n".join(filter(None, (
        f"distnorm: compiled {compiled} kernels ahead in {time.perf_counter() - start:.1f} s "
        "(worker processes, kernel cache)"
        + ("" if waited else f"; the other ranks' share was not in the cache after {WAIT_S:g} s"),
        note)))


def _nameable(key: tuple) -> bool:
    """Whether the kernel cache can name ``key`` (its builder takes those arguments)."""
    from distnorm.kernels.precompile import cached_path

    try:
        cached_path(key)
    except (TypeError, KeyError, ValueError):
        return False
    return True
