"""Run a function on N ranks from a plain ``python`` / ``pytest`` process.

    def body(x):                          # module-level, so it can be pickled
        import torch.distributed as dist
        ...
    spawn(body, 4, 1.0)                   # 4 processes, each: init_distributed(); body(1.0)
    run_distributed(body, 1.0)            # under torchrun/mpirun: run here; else spawn one per GPU

A child's exception comes back to the parent as AssertionError (child assertion) or RuntimeError,
with the child's traceback text; the other children are killed. Past ``timeout_s`` all children
are killed and TimeoutError raised: a stuck collective never hangs the parent.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from distnorm.launch.env import detect_launch_env, gpu_sharing_requested, without_launcher_vars

__all__ = ["spawn", "in_multiprocess_launch", "run_distributed", "launch_world_size"]

_EXIT_GRACE_S = 30.0  # after every rank reported success, how long exiting may take


def in_multiprocess_launch() -> bool:
    """True when torchrun, mpirun or spawn() started this process (its rank variables are set)."""
    return detect_launch_env().is_multiprocess


def launch_world_size() -> int:
    """Ranks a multi-GPU test will see: the launcher's world size, else the visible GPU count, or 2
    on one GPU with DISTNORM_SHARE_GPUS=1 (two self-started ranks share it: a correctness check)."""
    if in_multiprocess_launch():
        return detect_launch_env().world_size
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 1 and gpu_sharing_requested():
        return 2
    return gpus


#: How often spawn() starts a job whose ranks could not connect (see _is_transient_rendezvous).
RENDEZVOUS_ATTEMPTS = 3


class RendezvousError(RuntimeError):
    """A spawned job's ranks could not connect to each other (before any rank ran its body)."""


def failure_kind(e: BaseException) -> str:
    """How a rank's exception reaches the parent: "skip" (pytest.skip), "assert", or "error"."""
    if type(e).__module__.startswith("_pytest") and type(e).__name__ == "Skipped":
        return "skip"
    return "assert" if isinstance(e, AssertionError) else "error"


def _is_transient_rendezvous(e: BaseException) -> bool:
    """Connection failures of torch.distributed's start that a new attempt can get past: the
    store's port taken (EADDRINUSE) or Gloo's full-mesh connect dropped, seen with several jobs
    starting at once on a loaded 2-core machine ("Connection closed by peer" in connectFullMesh)."""
    text = f"{type(e).__name__}: {e}"
    return any(sign in text for sign in ("DistNetworkError", "EADDRINUSE", "connectFullMesh",
                                         "Address already in use"))


def raise_rank_failure(kind: str, rank: int, nprocs: int, summary: str, tb: str,
                       others: list[str]) -> None:
    """Raise in the parent what rank ``rank`` raised: pytest's skip, AssertionError (a failed check)
    or RuntimeError, with its traceback and the other ranks' failures."""
    if kind == "skip":
        import pytest

        pytest.skip(f"rank {rank}: {summary}")
    message = f"rank {rank} of {nprocs} failed: {summary}\n--- child traceback ---\n{tb}"
    if others:
        message += "\n--- other ranks failed too (possibly as a consequence) ---\n"
        message += "\n".join(others)
    raise {"assert": AssertionError, "rendezvous": RendezvousError}.get(kind, RuntimeError)(message)


def _child_environ(rank: int, nprocs: int, port: int, extra_env: Mapping[str, str],
                   cpu_only: bool) -> dict[str, str]:
    """The environment of child ``rank``: the parent's without its launcher's variables (the child
    belongs to its own job of ``nprocs``, not to the parent's), plus ``extra_env`` and its place.
    A ``cpu_only`` child sees no GPU (``CUDA_VISIBLE_DEVICES`` empty unless ``extra_env`` sets it):
    nothing in it can pick a GPU by accident, and it skips the driver's start-up on one."""
    environ = without_launcher_vars(os.environ)
    if cpu_only:
        environ["CUDA_VISIBLE_DEVICES"] = ""
    environ.update(extra_env)
    environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                    "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)})
    return environ


def _child(fn: Callable[..., Any], args: tuple, rank: int, nprocs: int, port: int,
           backend: str | None, timeout_s: float, extra_env: Mapping[str, str], cpu_only: bool,
           results: Any) -> None:
    # Replaced before anything reads it (torch.distributed, MPI, detect_launch_env). Module-level
    # code of fn's module already ran with the inherited environment while fn was unpickled.
    environ = _child_environ(rank, nprocs, port, extra_env, cpu_only)
    os.environ.clear()
    os.environ.update(environ)
    from distnorm.launch.dist import cleanup, init_distributed

    started = False
    try:
        init_distributed(backend=backend, timeout_s=timeout_s, cuda=False if cpu_only else None)
        started = True
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        # Report before tearing anything down: closing connections first would make the other
        # ranks fail too, and their (secondary) errors could reach the parent first.
        kind = "rendezvous" if not started and _is_transient_rendezvous(e) else failure_kind(e)
        results.put((kind, rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        results.close()
        results.join_thread()
        os._exit(1)
    cleanup()
    results.put(("ok", rank, "", ""))
    results.close()
    results.join_thread()


def _other_failures(results: Any, procs: list[Any], reported: set[int], deadline: float,
                    grace_s: float = 2.0) -> list[str]:
    """Collect other ranks' failure summaries for a short while after the first failure."""
    out: list[str] = []
    end = min(time.monotonic() + grace_s, deadline)
    while len(reported) < len(procs) and time.monotonic() < end:
        try:
            kind, rank, summary, _tb = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue_mod.Empty:
            break
        reported.add(rank)
        if kind != "ok":
            out.append(f"rank {rank}: {summary}")
    return out


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 300.0,
          backend: str | None = None, env: Mapping[str, str] | None = None,
          cpu_only: bool = False) -> None:
    """Start ``nprocs`` processes (multiprocessing "spawn"); each runs init_distributed() then fn(*args).

    fn and args must be picklable (fn defined at module level). ``env`` adds environment variables
    in the children. The children form their own job: they never inherit the rank variables of a
    launcher (torchrun, mpirun) that started this process. ``cpu_only=True`` keeps them off the
    GPUs (gloo, no GPU visible to them), so CPU work may use more ranks than there are GPUs.
    Returns when every child finished; raises on the first failure or timeout.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not isinstance(cpu_only, bool):
        raise TypeError(f"cpu_only must be a bool, got {type(cpu_only).__name__}")
    if cpu_only and backend is not None and "nccl" in backend:
        raise ValueError(f"backend {backend!r} needs GPUs, but cpu_only=True")
    deadline = time.monotonic() + timeout_s
    _again_if_ranks_cannot_connect(lambda: _spawn_once(
        fn, nprocs, args, max(deadline - time.monotonic(), 1.0), backend, env, cpu_only), deadline)


def _again_if_ranks_cannot_connect(start_job: Callable[[], None], deadline: float) -> None:
    """start_job(), again (up to RENDEZVOUS_ATTEMPTS in all, before ``deadline``) when its ranks
    could not connect: no body ran, so a fresh job on a new port is safe."""
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            start_job()
            return
        except RendezvousError:
            if attempt == RENDEZVOUS_ATTEMPTS or time.monotonic() >= deadline:
                raise


def _spawn_once(fn: Callable[..., Any], nprocs: int, args: tuple, timeout_s: float,
                backend: str | None, env: Mapping[str, str] | None, cpu_only: bool) -> None:
    from distnorm.launch.dist import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, name=f"distnorm-rank{rank}",
                         args=(fn, args, rank, nprocs, port, backend, timeout_s, dict(env or {}),
                               cpu_only, results))
             for rank in range(nprocs)]
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    ok = False
    try:
        for p in procs:
            p.start()
        while len(done) < nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"spawn({getattr(fn, '__name__', fn)}, {nprocs}): ranks "
                                   f"{sorted(set(range(nprocs)) - done)} still running after "
                                   f"{timeout_s:g} s; killed all children")
            try:
                kind, rank, summary, tb = results.get(timeout=min(remaining, 0.1))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead:
                    try:  # a message may still be in flight from a child that just exited
                        kind, rank, summary, tb = results.get(timeout=1.0)
                    except queue_mod.Empty:
                        r = dead[0]
                        raise RuntimeError(f"rank {r} of {nprocs} exited with code "
                                           f"{procs[r].exitcode} without reporting") from None
                else:
                    continue
            if kind == "ok":
                done.add(rank)
                continue
            raise_rank_failure(kind, rank, nprocs, summary, tb,
                               _other_failures(results, procs, done | {rank}, deadline))
        ok = True
    finally:
        hung: list[int] = []
        if ok:  # every body passed; give the processes a while to exit on their own
            exit_deadline = time.monotonic() + _EXIT_GRACE_S
            for p in procs:
                p.join(timeout=max(exit_deadline - time.monotonic(), 0.1))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
        _stop(procs)
        results.close()
    if hung:
        warnings.warn(f"spawn: ranks {hung} passed but did not exit within {_EXIT_GRACE_S:g} s "
                      "(stuck in library teardown); killed them", RuntimeWarning, stacklevel=2)
    bad = [(r, p.exitcode) for r, p in enumerate(procs)
           if p.exitcode not in (0, None) and r not in hung]
    if bad:
        raise RuntimeError(f"children passed but exited with non-zero codes (rank, code): {bad}")


def run_distributed(fn: Callable[..., Any], *args: Any, nprocs: int | None = None,
                    timeout_s: float = 300.0, backend: str | None = None,
                    reuse: bool = True) -> None:
    """Run ``fn(*args)`` on every rank: directly under torchrun/mpirun, else on self-started ranks.

    Under a launcher the job's world is used as is (``nprocs`` is ignored) and torch.distributed
    stays initialized for the next call; otherwise ``nprocs`` defaults to ``launch_world_size()``
    and the ranks are this process's persistent pool (launch/pool.py: started once, so later calls
    skip the start-up and compiles), or fresh processes per call with ``reuse=False`` (spawn()).
    """
    if in_multiprocess_launch():
        from distnorm.launch.dist import init_distributed

        init_distributed(backend=backend, timeout_s=timeout_s)
        fn(*args)
        return
    if nprocs is None:
        nprocs = launch_world_size()
    if not reuse:
        spawn(fn, nprocs, *args, timeout_s=timeout_s, backend=backend)
        return
    from distnorm.launch.pool import shared_pool

    # a pool whose ranks could not connect is closed; shared_pool then starts a fresh one
    _again_if_ranks_cannot_connect(
        lambda: shared_pool(nprocs, backend).run(fn, *args, timeout_s=timeout_s), float("inf"))
