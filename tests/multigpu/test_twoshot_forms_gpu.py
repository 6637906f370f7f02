"""The two-shot kernel's forms (NOTE [two-shot forms] in distnorm/kernels/allreduce.py: "push",
"pull-gather", "pull"): each meets the reference on every element, and all three give the same
bytes (same float32 operations, other traffic). Back-to-back calls mixing the forms with the other
algorithms, never synchronized in between, check the barriers that keep a pulling peer's reads
apart from the next call's writes.

    torchrun --nproc-per-node 2 -m pytest tests/multigpu/test_twoshot_forms_gpu.py -q
    mpirun -np 2 python -m pytest tests/multigpu/test_twoshot_forms_gpu.py -q
    python -m pytest tests/multigpu/test_twoshot_forms_gpu.py -q    # spawns one process per GPU
"""
from __future__ import annotations

import os
import sys

import torch

from allreduce_cases import (BUFFER_BYTES, algo_capacity_rows, checked_on_every_rank,
                             group_bootstrap, make_inputs, quant_kwargs, quant_spec)
from harness import MULTIGPU_MARKS, all_gather_tensors, gathered_check
from distnorm.launch import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = MULTIGPU_MARKS
QUICK = os.environ.get("DISTNORM_QUICK") == "1"
TIMEOUT_S = 400
H = 4096
# (format, M): a row, ragged slices, padded scale rows, the plain all-reduce, chunked launches
CASES = [("none", 1), ("fp8_per_token", 3), ("nvfp4", 300), ("fp8", 1000), ("mxfp8", "cap+1")]
MIXED_CALLS = 60 if QUICK else 300
MIXED_SIZES = (1, 7, 300, 2048, 64)


def _tuned(ws, form: str) -> None:
    import dataclasses

    from distnorm.collectives.state import state_of
    state = state_of(ws)
    state.tuning = dataclasses.replace(state.tuning, twoshot_form=form)


def _body_forms_agree() -> None:
    from distnorm.collectives.plan import TWOSHOT_FORMS
    from distnorm.comm import Workspace

    from distnorm.collectives.state import state_of

    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        assert ws.p2p_ok, f"no peer mappings: {ws.fallback_reason}"
        first = {}
        kernels_of = {}  # form -> the compiled kernels its calls were planned with
        for form in TWOSHOT_FORMS:
            _tuned(ws, form)
            kernels = kernels_of[form] = set()
            for seed, (qname, M) in enumerate(CASES):
                if M == "cap+1":
                    M = algo_capacity_rows("twoshot", ws.world_size, H, quant_spec(qname)) + 1
                what = f"twoshot {form} {qname} M={M}"
                digests = checked_on_every_rank(boot, ws, what, "twoshot", qname, M, H, 60 + seed)
                first.setdefault((qname, M), (form, digests))
                was, want = first[(qname, M)]
                assert digests == want, f"{what}: outputs differ from the {was} form's"
                kernels.update(id(call.kernel) for call in state_of(ws)._calls.values())
        # each form ran kernels of its own (the Tuning reached the kernel key)
        forms = list(kernels_of)
        for a, b in zip(forms, forms[1:]):
            assert not kernels_of[a] & kernels_of[b], f"the {a} and {b} forms shared kernels"
        ws.barrier()


def _body_mixed_back_to_back(calls: int) -> None:
    from distnorm.collectives import allreduce_add_rmsnorm
    from distnorm.collectives.plan import TWOSHOT_FORMS
    from distnorm.comm import Workspace
    from distnorm.reference import allreduce_add_rmsnorm_ref

    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        kw, _ = quant_kwargs("fp8")
        data = {M: make_inputs(M, H, ws.rank, 700 + M, world=ws.world_size) for M in MIXED_SIZES}
        refs = {M: allreduce_add_rmsnorm_ref(all_gather_tensors(data[M][0]), data[M][1],
                                             data[M][2], 1e-6, **kw) for M in MIXED_SIZES}
        last = {}
        for i in range(calls):
            M = MIXED_SIZES[i % len(MIXED_SIZES)]
            step = i // len(MIXED_SIZES)
            algo = ("twoshot", "oneshot", "twoshot", "lamport", "twoshot")[step % 5]
            _tuned(ws, TWOSHOT_FORMS[step % len(TWOSHOT_FORMS)])
            x, res, w = data[M]
            last[M] = allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, algo=algo, **kw)
        torch.cuda.synchronize()

        def check():
            ws.raise_if_failed()
            for M in MIXED_SIZES:
                assert torch.equal(last[M].residual, refs[M].residual), f"M={M}: residual differs"
                eq = (last[M].q.view(torch.uint8) == refs[M].q.view(torch.uint8)).float().mean().item()
                assert eq >= 0.999, f"M={M}: only {eq} of fp8 bytes equal"
        gathered_check(boot, check)
        ws.barrier()


def kernel_keys(test: str, params: dict) -> list[tuple]:
    """The kernels these tests launch (tests/conftest.py compiles them ahead)."""
    import dataclasses

    from distnorm.collectives.dispatch import allreduce_kernel_key
    from distnorm.collectives.plan import TWOSHOT_FORMS, Tuning, plan_launch
    from distnorm.launch.spawn import launch_world_size

    world = launch_world_size()
    if world < 2:
        return []
    keys = []
    for form in TWOSHOT_FORMS:
        tuning = dataclasses.replace(Tuning.from_env(), twoshot_form=form)
        if test == "test_twoshot_forms_agree":
            for qname, _ in CASES:
                spec = quant_spec(qname)
                keys.append(("allreduce", *allreduce_kernel_key("twoshot", world, torch.bfloat16,
                                                                H, spec, True, False, True, True,
                                                                tuning)))
                if qname == "none":
                    keys.append(("allreduce", *allreduce_kernel_key(
                        "twoshot", world, torch.bfloat16, H, None, False, False, False, True,
                        tuning)))
        if test == "test_twoshot_forms_mixed_back_to_back":
            spec = quant_spec("fp8")
            for algo in ("twoshot", "oneshot", "lamport"):
                for M in MIXED_SIZES:
                    launched, _ = plan_launch(algo, world, M, H, 2, BUFFER_BYTES, False, False,
                                              False)
                    keys.append(("allreduce", *allreduce_kernel_key(
                        launched, world, torch.bfloat16, H, spec, True, False, False, False,
                        tuning)))
    return list(dict.fromkeys(keys))


def test_twoshot_forms_agree():
    run_distributed(_body_forms_agree, timeout_s=TIMEOUT_S)


def test_twoshot_forms_mixed_back_to_back():
    run_distributed(_body_mixed_back_to_back, MIXED_CALLS, timeout_s=TIMEOUT_S)
