"""Faults in the sequence-parallel reduce-scatter (distnorm.reduce_scatter_add_rmsnorm, gathered and
not) end in errors, as the all-reduce's do (test_faults_gpu.py): a rank that stops calling between
calls, then ranks that disagree on M; each time the other ranks' failing call raises (checked
mode) within the kernel timeout, every rank resets, and good calls follow (residual shards bitwise
the reference). In the default form and in the two forms whose waits are new: "pipelined-tma"
(bulk-copy pushes drained before each barrier, NOTE [bulk-copy pushes]) and "roles-tma" (flags and
counts instead of barriers, NOTE [reduce-scatter roles by TMA]): a wait there without a deadline
would hang this test instead of failing it. Every error's arrival time is printed (`-s`).

Kernel waits give up after 2 s and host waits after 3 s during the faults; the warm-up calls run
under a 10 s deadline, so that a rank still loading a kernel cannot make its peer time out.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from allreduce_cases import (BUFFER_BYTES, group_bootstrap, make_inputs, quant_spec,
                             rs_forms_under_test)
from harness import MULTIGPU_MARKS, all_gather_tensors
from distnorm.launch import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = MULTIGPU_MARKS
QUICK = os.environ.get("DISTNORM_QUICK") == "1"
TIMEOUT_S = 400
KERNEL_TIMEOUT_S, HOST_TIMEOUT_S, WARM_TIMEOUT_S = 2.0, 3.0, 10.0
# the default form and the two TMA forms (those only with DISTNORM_UNVERIFIED_FORMS=1)
FORMS = tuple(f for f in ("serial", "pipelined-tma", "roles-tma") if f in rs_forms_under_test())
M, H, QUANT = 512, 4096, "fp8_per_token"
MISMATCH_M = M // 2  # rank 1's rows in the mismatch
GOOD_CALLS = 200 if QUICK else 1000


def _tuning(form: str, timeout_s: float):
    from distnorm.collectives.plan import Tuning
    return Tuning(reducescatter_form=form, timeout_s=timeout_s, host_timeout_s=HOST_TIMEOUT_S)


def _call(ws, rows: int, gather: bool, seed: int):
    """One sequence-parallel call of rows x H on this rank's shard: (x, residual, weight, out)."""
    import distnorm
    x, res, w = make_inputs(rows, H, ws.rank, seed, world=ws.world_size)
    a, b = distnorm.shard_rows(rows, ws)
    out = distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6, workspace=ws, quant=QUANT,
                                              gather=gather)
    return x, res, w, out


def _raises_in_time(ws, what: str, fn) -> Exception:
    """fn() raises CommTimeoutError (or its CommMismatchError) within the kernel timeout + 3 s."""
    from distnorm.comm import CommTimeoutError
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError) as e:
        fn()
    took = time.monotonic() - t0
    print(f"\n[fault] rank {ws.rank}: {what}: {type(e.value).__name__} after {took:.3f} s: "
          f"{str(e.value)[:200]}", flush=True)
    assert took < KERNEL_TIMEOUT_S + 3.0, took
    return e.value


def _body_rs_faults(form: str) -> None:
    import distnorm
    from distnorm.collectives import check, reset
    from distnorm.collectives.state import AllReduceState, state_of
    from distnorm.comm import CommMismatchError, Workspace
    from distnorm.reference import allreduce_add_rmsnorm_ref

    boot = group_bootstrap()
    previous = distnorm.set_value_checks(True)  # the failing call itself raises
    ws = Workspace(buffer_bytes=BUFFER_BYTES)
    try:
        assert ws.p2p_ok, ws.fallback_reason
        ws.op_state("allreduce", lambda: AllReduceState(_tuning(form, WARM_TIMEOUT_S)))
        state = state_of(ws)
        for rows in (M, MISMATCH_M):  # every kernel of the test, on every rank, before 2 s waits
            for gather in (False, True):
                _call(ws, rows, gather, 0)
        torch.cuda.synchronize()
        boot.barrier()
        state.tuning = _tuning(form, KERNEL_TIMEOUT_S)

        # a rank that stops calling: the others' next call times out naming it
        if ws.rank == 1:
            boot.barrier()  # until the others have failed
        else:
            err = _raises_in_time(ws, f"rank 1 stopped calling, {form}",
                                  lambda: _call(ws, M, True, 99))
            assert err.peer in (1, -1), err
            boot.barrier()
        reset(ws)

        # ranks that disagree on M: every rank's call raises (at once where the kernels meet)
        rows = M if ws.rank == 0 else MISMATCH_M
        err = _raises_in_time(ws, f"M differs ({rows} here), {form}",
                              lambda: _call(ws, rows, False, 7))
        if isinstance(err, CommMismatchError):
            assert err.differences, err
        boot.barrier()
        reset(ws)

        # good calls after both recoveries, gathered and not; every 100th against the reference
        for i in range(GOOD_CALLS):
            x, res, w, out = _call(ws, M, i % 2 == 1, 1000 + i)
            if i % 100 == 99:
                ref = allreduce_add_rmsnorm_ref(all_gather_tensors(x), res, w, 1e-6, quant=QUANT)
                a, b = distnorm.shard_rows(M, ws)
                assert torch.equal(out.residual.view(torch.int16),
                                   ref.residual[a:b].view(torch.int16)), (form, i)
        torch.cuda.synchronize()
        check(ws)
    finally:
        distnorm.set_value_checks(previous)
        ws.close()


@pytest.mark.parametrize("form", FORMS)
def test_reducescatter_faults_then_recovery(form):
    run_distributed(_body_rs_faults, form, timeout_s=TIMEOUT_S)


def kernel_keys(test: str, params: dict) -> list[tuple]:
    """The kernels of these tests (tests/conftest.py compiles them ahead): the form's reduce-scatter
    and its gathered kernel at both row counts, y not written."""
    from allreduce_cases import scatter_keys
    from distnorm.launch.spawn import launch_world_size

    world = launch_world_size()
    if world < 2 or test != "test_reducescatter_faults_then_recovery":
        return []
    tuning = _tuning(params["form"], KERNEL_TIMEOUT_S)
    return list(dict.fromkeys(k for rows in (M, MISMATCH_M)
                              for k in scatter_keys(world, rows, H, quant_spec(QUANT), (False,),
                                                    tuning)))
