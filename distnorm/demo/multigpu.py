"""The library's main feature on every rank: distnorm.allreduce_add_rmsnorm over a Workspace, for
every selected variant, checked against distnorm.reference.allreduce_add_rmsnorm_ref (built from
every rank's x, all-gathered) and timed against the unfused path (NCCL all_reduce, then the
single-GPU distnorm.add_rmsnorm). Rank 0 prints a progress line per case and the final table; a
case passes when it passes on every rank, and times are the max over ranks.

Runs on the ranks of a launcher (torchrun / mpirun) or self-spawned, one process per GPU
(run_multigpu). The main job runs it on GPUs only (a Workspace needs CUDA); without CUDA, rank_main
checks the op's CPU path (gloo, the reference) and times nothing, which is how it is tested on CPU.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

import distnorm
from distnorm.demo.cases import EPS, DemoConfig, make_inputs, quant_kwargs
from distnorm.demo.check import CheckResult, compare
from distnorm.demo.table import Row, render, summary
from distnorm.demo.timing import CALLS_PER_GRAPH, time_us
from distnorm.launch import cleanup, in_multiprocess_launch, init_distributed, spawn
from distnorm.reference import allreduce_add_rmsnorm_ref

TIME_COLUMNS = ("fused", "nccl+norm")
_NO_MATCH = 2.0  # stands for "nothing compared" (M = 0) in a MIN over ranks of fractions
SPAWN_TIMEOUT_S = 3600.0  # every rank compiles each variant's kernels once: minutes, not seconds


def _device() -> str:
    """Where this rank's tensors live: its GPU (NCCL), else the CPU (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _over_ranks(values: list, op) -> list:
    """Floats (the same count on every rank) reduced over the ranks with `op` (a collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def _all_ranks_ok(ok: bool) -> bool:
    return _over_ranks([1.0 if ok else 0.0], dist.ReduceOp.MIN)[0] == 1.0


def _gathered(x: torch.Tensor) -> list:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _times(cfg: DemoConfig, x, residual, weight, kw: dict, ws) -> tuple:
    """((fused us, unfused us) max over ranks, both CUDA graphs) on this GPU."""
    scratch = x.clone()  # all_reduce works in place; its values grow, which costs NCCL nothing

    def unfused() -> None:
        dist.all_reduce(scratch)
        distnorm.add_rmsnorm(scratch, residual, weight, EPS, **kw)

    fused_us, fused_graph = time_us(
        lambda: distnorm.allreduce_add_rmsnorm(x, residual, weight, EPS, workspace=ws, **kw),
        cfg.iters, _all_ranks_ok)
    unfused_us, unfused_graph = time_us(unfused, cfg.iters, _all_ranks_ok)
    times = tuple(_over_ranks([fused_us, unfused_us], dist.ReduceOp.MAX))
    return times, fused_graph and unfused_graph


def run_case(cfg: DemoConfig, case, index: int, ws) -> Row:
    """Check (and on GPUs, time) one variant on this rank; the Row holds the result of all ranks.
    Collective: every rank calls it with the same case."""
    device = _device()
    x, residual, weight = make_inputs(cfg, index, device, dist.get_rank())
    kw = quant_kwargs(case, device)
    ref = allreduce_add_rmsnorm_ref(_gathered(x), residual, weight, EPS, **kw)
    try:
        out = distnorm.allreduce_add_rmsnorm(x, residual, weight, EPS, workspace=ws, **kw)
        result = compare(out, ref, case.spec)
    except Exception as e:  # noqa: BLE001 - a FAIL row; the other ranks learn it below
        result = CheckResult(False, 0.0, f"{type(e).__name__}: {e}")
    ok = _all_ranks_ok(result.ok)
    # the worst rank's match; every rank takes part (a rank whose op raised has 0.0, not None)
    match = _over_ranks([_NO_MATCH if result.match is None else result.match], dist.ReduceOp.MIN)[0]
    match = None if match == _NO_MATCH else match
    problem = result.problem or ("" if ok else "fails on another rank")
    if device == "cpu":
        return Row(case.name, ok, match, problem=problem)
    times, graph = (None, None), True
    if cfg.tokens > 0 and ok:  # M = 0 is a valid call, but there is nothing to time
        times, graph = _times(cfg, x, residual, weight, kw, ws)
    return Row(case.name, ok, match, times, graph, problem)


def progress_line(i: int, n: int, row: Row) -> str:
    """'[i/n] name: ok, fused X us, nccl+norm Y us' (times left out when not measured)."""
    timing = ", ".join(f"{c} {t:.2f} us" for c, t in zip(TIME_COLUMNS, row.times_us)
                       if t is not None)
    status = "ok" if row.ok else f"FAIL ({row.problem})"
    return f"[{i}/{n}] {row.name}: {status}" + (f", {timing}" if timing else "")


def _describe(cfg: DemoConfig, world: int, ws) -> str:
    shape = f"M={cfg.tokens}, H={cfg.hidden}, {cfg.dtype}"
    if _device() == "cpu":
        what = f"all-reduce on {world} CPU ranks ({shape}): checks the CPU path only, no timing"
    else:
        what = (f"fused all-reduce on {world} GPUs, {torch.cuda.get_device_name()} ({shape}): "
                f"allreduce_add_rmsnorm vs NCCL all_reduce + add_rmsnorm; us per call (CUDA graph "
                f"of {CALLS_PER_GRAPH} calls, median of {cfg.iters} replays, max over ranks)")
    if not ws.p2p_ok:
        what += (f"\nnote: the workspace has no peer mappings ({ws.fallback_reason}): the fused op "
                 "runs its fallback (all-gather + single-GPU kernel), not the all-reduce kernels")
    return what


def rank_main(cfg: DemoConfig, cases: list, result_path: str = "",
              make_workspace: Callable = distnorm.Workspace) -> int:
    """Every rank's body (torch.distributed initialized). Returns the number of failed variants
    (the same on every rank); rank 0 also writes it to result_path when one is given.
    make_workspace(group) builds the workspace (closed at the end)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ws = make_workspace(dist.group.WORLD)
    rows = []
    try:
        if rank == 0:
            print("\n" + _describe(cfg, world, ws), flush=True)
        for i, case in enumerate(cases):
            rows.append(run_case(cfg, case, i, ws))
            if rank == 0:
                print(progress_line(i + 1, len(cases), rows[-1]), flush=True)
    finally:
        ws.close()
    failures = sum(not r.ok for r in rows)
    if rank == 0:
        timed = _device() == "cuda"
        print(render(rows, TIME_COLUMNS if timed else (), speedup=timed))
        print(summary(rows, f"all-reduce variants on {world} ranks"), flush=True)
        if result_path:
            with open(result_path, "w") as f:
                json.dump({"failures": failures}, f)
    return failures


def run_multigpu(cfg: DemoConfig, cases: list, nprocs: int) -> int:
    """Under torchrun / mpirun: rank_main on this rank (returns the job's failures). Otherwise
    spawn one process per GPU (nprocs) and return the failures rank 0 reported (1 if a rank
    crashed)."""
    if in_multiprocess_launch():
        init_distributed()
        try:
            return rank_main(cfg, cases)
        finally:
            cleanup()
    with tempfile.TemporaryDirectory(prefix="distnorm-main-") as tmp:
        path = os.path.join(tmp, "result.json")
        try:
            spawn(rank_main, nprocs, cfg, cases, path, timeout_s=SPAWN_TIMEOUT_S)
        except (RuntimeError, AssertionError, TimeoutError) as e:
            print(f"multi-GPU run failed: {e}", flush=True)
            return 1
        with open(path) as f:
            return int(json.load(f)["failures"])
