"""Multi-GPU tests of the cross-rank CTA barrier (distnorm.kernels.sync.cta_barrier).

Run any of:
    torchrun --nproc-per-node 2 -m pytest tests/multigpu/test_barrier_gpu.py -q
    python -m pytest tests/multigpu/test_barrier_gpu.py -q     # spawns one process per GPU

Bodies are module-level functions (spawn() pickles them); every check is gathered over the group
before asserting, so one rank's failure fails all ranks instead of leaving them in a collective.
"""
import time

import pytest
import torch

from distnorm.comm import CommTimeoutError, Workspace, resolve_bootstrap
from harness import MULTIGPU_MARKS, TIMEOUT_S, gathered_check as _gathered_check
from distnorm.launch import run_distributed

pytestmark = MULTIGPU_MARKS
MiB = 1 << 20



def _workspace():
    ws = Workspace(buffer_bytes=4 * MiB, signal_bytes=1 * MiB)
    if not ws.p2p_ok:
        ws.close()
        pytest.skip(f"no peer mappings: {ws.fallback_reason}")
    return ws


def _body_rounds(rounds: int) -> None:
    from barrier_kernel import run_barrier_rounds

    boot = resolve_bootstrap(None)
    with _workspace() as ws:
        for ctas in (1, 8):
            def check(ctas=ctas):
                bad = run_barrier_rounds(ws, rounds, ctas=ctas, timeout_s=30)
                assert bad == 0, f"{bad} mismatching words with {ctas} CTAs over {rounds} rounds"
            _gathered_check(boot, check)
        _gathered_check(boot, lambda: run_barrier_rounds(ws, 1000, ctas=8, barrier_only=True,
                                                         timeout_s=30))
        # back-to-back launches continue the epochs: the check mode still sees fresh data
        _gathered_check(boot, lambda: [run_barrier_rounds(ws, 3, ctas=8, timeout_s=30)
                                       for _ in range(20)])
        ws.barrier()


def _body_graph() -> None:
    from barrier_kernel import error_view, launch_barrier_rounds, run_barrier_rounds

    boot = resolve_bootstrap(None)
    with _workspace() as ws:
        _gathered_check(boot, lambda: run_barrier_rounds(ws, 10, ctas=8, timeout_s=30))  # compile, warm
        out = torch.zeros(1, dtype=torch.int32, device=ws.device)
        err = error_view(ws)
        stream = torch.cuda.Stream(ws.device)
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(g, stream=stream):
                launch_barrier_rounds(ws, 100, ctas=8, timeout_s=30, out=out, err=err)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        ws.barrier()

        def replay():
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            ws.raise_if_failed()
            assert int(out.item()) == 0, f"{int(out.item())} mismatches over 10 graph replays"
            # eager launches after the replays still agree with the peers on the epochs
            assert run_barrier_rounds(ws, 50, ctas=8, timeout_s=30) == 0
            g.replay()
            torch.cuda.synchronize()
            ws.raise_if_failed()
            assert int(out.item()) == 0
        _gathered_check(boot, replay)
        del g
        ws.barrier()


def _body_timeout() -> None:
    from barrier_kernel import compiled_barrier_rounds, run_barrier_rounds
    from distnorm.collectives.layout import REGION_BARRIER_TEST
    from distnorm.collectives.state import zero_region

    boot = resolve_bootstrap(None)
    with _workspace() as ws:
        compiled_barrier_rounds(ws.world_size, False)  # compile outside the timed part
        absent = ws.world_size - 1

        def arrive_alone():
            if ws.rank == absent:
                return None  # this rank never launches
            t0 = time.monotonic()
            try:
                run_barrier_rounds(ws, 1, ctas=8, timeout_s=1)
            except CommTimeoutError as e:
                elapsed = time.monotonic() - t0
                assert e.code == 1 and e.rank == ws.rank, (e.code, e.rank)
                assert 0.9 <= elapsed <= 3.5, f"timed out after {elapsed:.2f} s, wanted ~1 s"
                assert "rank" in str(e)
                ws.reset_error()
                ws.raise_if_failed()
                return elapsed
            raise AssertionError("the barrier returned although rank "
                                 f"{absent} never arrived")
        _gathered_check(boot, arrive_alone)
        # epochs are now out of step: every rank zeroes its region while nothing runs
        torch.cuda.synchronize()
        ws.barrier()
        zero_region(ws, REGION_BARRIER_TEST)
        ws.barrier()

        def after_reset():
            bad = run_barrier_rounds(ws, 100, ctas=8, timeout_s=30)
            assert bad == 0, f"{bad} mismatches after the reset"
        _gathered_check(boot, after_reset)
        ws.barrier()


def test_barrier_rounds_1_and_8_ctas():
    run_distributed(_body_rounds, 10_000, timeout_s=TIMEOUT_S)


def test_barrier_graph_replay():
    run_distributed(_body_graph, timeout_s=TIMEOUT_S)


def test_barrier_timeout_when_a_rank_never_arrives():
    run_distributed(_body_timeout, timeout_s=TIMEOUT_S)
