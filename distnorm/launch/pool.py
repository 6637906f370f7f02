"""Persistent ranks for run_distributed() under a plain ``python`` / ``pytest`` process.

spawn() starts fresh processes for every call: torch import, CUDA and NCCL start-up and every kernel
compile are paid again each time (about 10 s per multi-GPU test on 2 x H200, most of a plain pytest
run). A RankPool starts its ranks once, keeps torch.distributed and the compile caches up, and runs
one function after another on all of them. Any failure or timeout kills the pool (a rank that failed
may have left a collective half done); the next run starts a fresh one.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from distnorm.launch.spawn import (_child_environ, _is_transient_rendezvous, failure_kind,
                                   raise_rank_failure)

__all__ = ["RankPool", "shared_pool", "close_shared_pool"]


def _worker(rank: int, nprocs: int, port: int, backend: str | None, timeout_s: float,
            cpu_only: bool, tasks: Any, results: Any) -> None:
    environ = _child_environ(rank, nprocs, port, {}, cpu_only)
    os.environ.clear()
    os.environ.update(environ)
    from distnorm.launch.dist import cleanup, init_distributed

    try:
        init_distributed(backend=backend, timeout_s=timeout_s, cuda=False if cpu_only else None)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        kind = "rendezvous" if _is_transient_rendezvous(e) else "error"
        results.put((kind, rank, f"start-up: {type(e).__name__}: {e}", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            fn(*args)
            results.put(("ok", rank, "", ""))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            results.put((failure_kind(e), rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    cleanup()


class RankPool:
    """``nprocs`` persistent ranks with torch.distributed up (see the module docstring).

    run(fn, *args) runs fn(*args) on every rank (fn picklable, defined at module level) and
    raises like spawn(): AssertionError / RuntimeError with the failing rank's traceback,
    pytest's skip when a rank skipped, TimeoutError past timeout_s.
    """

    def __init__(self, nprocs: int, backend: str | None = None, timeout_s: float = 300.0,
                 cpu_only: bool = False) -> None:
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
        from distnorm.launch.dist import free_port

        self.nprocs, self.backend, self.cpu_only = nprocs, backend, cpu_only
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(nprocs)]
        port = free_port()
        self._procs = [ctx.Process(target=_worker, name=f"distnorm-pool-rank{rank}", daemon=True,
                                   args=(rank, nprocs, port, backend, timeout_s, cpu_only,
                                         self._tasks[rank], self._results))
                       for rank in range(nprocs)]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> None:
        if not self.alive:
            raise RuntimeError("the rank pool is closed or lost a rank")
        for q in self._tasks:
            q.put((fn, args))
        deadline = time.monotonic() + timeout_s
        reports: dict[int, tuple] = {}
        first_failure = None
        while len(reports) < self.nprocs:
            remaining = deadline - time.monotonic()
            if first_failure is not None:  # give the others a moment, then stop waiting
                remaining = min(remaining, first_failure + 2.0 - time.monotonic())
            if remaining <= 0:
                break
            try:
                kind, rank, summary, tb = self._results.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                if not self.alive and first_failure is None:
                    first_failure = time.monotonic()
                continue
            reports[rank] = (kind, summary, tb)
            if kind != "ok" and first_failure is None:
                first_failure = time.monotonic()
        self._raise_for(fn, reports, timeout_s)

    def _raise_for(self, fn: Callable[..., Any], reports: dict, timeout_s: float) -> None:
        kinds = {kind for kind, _, _ in reports.values()}
        if len(reports) == self.nprocs and kinds <= {"ok", "skip"}:
            if "skip" in kinds:
                rank = min(r for r, (k, _, _) in reports.items() if k == "skip")
                raise_rank_failure("skip", rank, self.nprocs, reports[rank][1], "", [])
            return
        self.close()  # a failed or missing rank may have left a collective half done
        failed = sorted(r for r, (k, _, _) in reports.items() if k not in ("ok", "skip"))
        if not failed:
            missing = sorted(set(range(self.nprocs)) - set(reports))
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {self.nprocs} pooled ranks: "
                               f"ranks {missing} did not finish within {timeout_s:g} s (or died); "
                               "killed the pool")
        rank = failed[0]
        kind, summary, tb = reports[rank]
        raise_rank_failure(kind, rank, self.nprocs, summary, tb,
                           [f"rank {r}: {reports[r][1]}" for r in failed[1:]])

    def close(self) -> None:
        """Stop the ranks (politely, then by force). Idempotent."""
        procs, self._procs = self._procs, []
        for p, q in zip(procs, self._tasks):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 10.0
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_shared: dict[tuple, RankPool] = {}  # one pool per (nprocs, backend) for this process


def shared_pool(nprocs: int, backend: str | None = None, timeout_s: float = 300.0) -> RankPool:
    """This process's pool of ``nprocs`` ranks (started on first use, restarted after a failure)."""
    key = (nprocs, backend)
    pool = _shared.get(key)
    if pool is None or not pool.alive:
        for other in list(_shared.values()):  # one pool at a time: each holds every GPU
            other.close()
        _shared.clear()
        pool = _shared[key] = RankPool(nprocs, backend, timeout_s)
    return pool


def close_shared_pool() -> None:
    for pool in list(_shared.values()):
        pool.close()
    _shared.clear()


atexit.register(close_shared_pool)
