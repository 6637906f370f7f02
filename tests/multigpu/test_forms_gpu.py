"""The algorithms' forms (distnorm.collectives.plan.ALGORITHM_FORMS: two-shot "push", "pull-gather",
"pull", NOTE [two-shot forms] in distnorm/kernels/twoshot.py; lamport "poll-all", "poll-unseen",
NOTE [lamport polls] in distnorm/kernels/lamport.py; the sequence-parallel reduce-scatter's
REDUCESCATTER_FORMS, "serial" and the pipelined ones, NOTE [reduce-scatter rounds], the TMA one also
with one row per CTA and a strided x, NOTE [bulk-copy pushes], and "roles-tma", NOTE [reduce-scatter
roles by TMA], also with a strided x; the two TMA forms only with DISTNORM_UNVERIFIED_FORMS=1, until a
GPU run has passed them): each meets the
reference on every element and every form of an algorithm gives the same bytes (same float32
operations, other traffic).
Back-to-back calls that mix the forms with the other algorithms, never synchronized in between,
check the barriers and areas that keep a peer's reads apart from the next call's writes.

    torchrun --nproc-per-node 2 -m pytest tests/multigpu/test_forms_gpu.py -q
    mpirun -np 2 python -m pytest tests/multigpu/test_forms_gpu.py -q
    python -m pytest tests/multigpu/test_forms_gpu.py -q    # spawns one process per GPU
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from allreduce_cases import (BUFFER_BYTES, algo_capacity_rows, checked_on_every_rank,
                             group_bootstrap, make_inputs, quant_kwargs, quant_spec,
                             rs_forms_under_test)
from harness import MULTIGPU_MARKS, all_gather_tensors, gathered_check
from distnorm.collectives.plan import ALGORITHM_FORMS
from distnorm.launch import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = MULTIGPU_MARKS
QUICK = os.environ.get("DISTNORM_QUICK") == "1"
FULL = os.environ.get("DISTNORM_FULL") == "1"
TIMEOUT_S = 400
H = 4096
# (format, M): ragged slices, padded scale rows, chunked launches with the plain all-reduce and the
# gathered T(acc); the mixed test runs the first format's kernels (compiles are what these cost)
CASES = [("fp8_per_token", 3), ("nvfp4", 100), ("none", "cap+1")]
if FULL:
    CASES += [("none", 1), ("fp8", 1000), ("mxfp8", "cap+1")]
MIXED_CALLS = 60 if QUICK else 300
MIXED_SIZES = (1, 7, 100, 2048, 64)
MIXED_FORMAT = CASES[0][0]
MIXED_ALGOS = ("twoshot", "oneshot", "lamport", "twoshot", "lamport")
# the all-reduce algorithms' forms (the reduce-scatter's have their own test)
ALLREDUCE_FORMS = {a: f for a, f in ALGORITHM_FORMS.items()
                   if a not in ("reducescatter", "rowgather")}
# (format, M, max_ctas): the reduce-scatter's shards; 8 CTAs cut 65 rows into uneven rounds and
# more rounds than rows, 1000 rows per shard take every CTA of the grid for several groups
RS_CASES = [("fp8_per_token", 2000, 0), ("nvfp4", 129, 8), ("none", 3, 0), ("mxfp8", 1000, 5)]
# NOTE [bulk-copy pushes]: besides its default rows per CTA (at H 4096 and 2 ranks a round of one
# row group), the TMA form with one row per CTA (rounds of two groups, two parts of each stage)
TMA_FORM, TMA_R1 = "pipelined-tma", "pipelined-tma r1"
# NOTE [reduce-scatter roles by TMA]: pusher and finisher CTAs (with a strided x too); the caps of
# RS_CASES leave 7 and 4 pushers (max_ctas 8, 5) and one finisher for all the shard's row groups
ROLES_FORM = "roles-tma"
# the forms run here (the unverified TMA forms only with DISTNORM_UNVERIFIED_FORMS=1), and the
# TMA form with one row per CTA beside them
RS_FORMS = rs_forms_under_test()
RS_VARIANTS = RS_FORMS + ((TMA_R1,) if TMA_FORM in RS_FORMS else ())


def _tuned(ws, algo: str, form: str) -> None:
    """The workspace's calls from now on use `form` for `algo` (its planned calls are dropped).
    The two-shot rounds forms also get a grid of 8 CTAs, so that a CTA's row groups take several
    rounds at the test's sizes (NOTE [two-shot rounds]; the grid does not change the bits)."""
    import dataclasses

    from distnorm.collectives.state import state_of
    state = state_of(ws)
    caps = {a: n for a, n in state.tuning.max_ctas.items() if a != algo}
    if form.endswith("-rounds"):
        caps[algo] = 8
    state.tuning = dataclasses.replace(state.tuning, **{f"{algo}_form": form}, max_ctas=caps)


def _body_forms_agree(algo: str) -> None:
    from distnorm.collectives.state import state_of
    from distnorm.comm import Workspace

    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        assert ws.p2p_ok, f"no peer mappings: {ws.fallback_reason}"
        first = {}
        kernels_of = {}  # form -> the compiled kernels of its calls that ran `algo`
        for form in ALGORITHM_FORMS[algo]:
            _tuned(ws, algo, form)
            kernels = kernels_of[form] = set()
            for seed, (qname, M) in enumerate(CASES):
                if M == "cap+1":
                    M = algo_capacity_rows(algo, ws.world_size, H, quant_spec(qname)) + 1
                what = f"{algo} {form} {qname} M={M}"
                digests = checked_on_every_rank(boot, ws, what, algo, qname, M, H, 60 + seed)
                first.setdefault((qname, M), (form, digests))
                was, want = first[(qname, M)]
                assert digests == want, f"{what}: outputs differ from the {was} form's"
                kernels.update(id(c.kernel) for c in state_of(ws)._calls.values() if c.algo == algo)
        # each form ran kernels of its own (the Tuning reached the kernel key)
        forms = list(kernels_of)
        assert all(kernels_of.values()), f"{algo}: a form ran no {algo} kernel"
        for a, b in zip(forms, forms[1:]):
            assert not kernels_of[a] & kernels_of[b], f"the {a} and {b} forms shared kernels"
        ws.barrier()


def _body_mixed_back_to_back(calls: int) -> None:
    from distnorm.collectives import allreduce_add_rmsnorm
    from distnorm.comm import Workspace
    from distnorm.reference import allreduce_add_rmsnorm_ref

    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        kw, _ = quant_kwargs(MIXED_FORMAT)
        data = {M: make_inputs(M, H, ws.rank, 700 + M, world=ws.world_size) for M in MIXED_SIZES}
        refs = {M: allreduce_add_rmsnorm_ref(all_gather_tensors(data[M][0]), data[M][1],
                                             data[M][2], 1e-6, norm_out=True, allreduce_out=True,
                                             **kw) for M in MIXED_SIZES}
        last = {}
        for i in range(calls):
            M = MIXED_SIZES[i % len(MIXED_SIZES)]
            step = i // len(MIXED_SIZES)
            algo = MIXED_ALGOS[step % len(MIXED_ALGOS)]
            if algo in ALGORITHM_FORMS:
                forms = ALGORITHM_FORMS[algo]
                _tuned(ws, algo, forms[step % len(forms)])
            x, res, w = data[M]
            last[M] = allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, algo=algo,
                                            norm_out=True, allreduce_out=True, **kw)
        torch.cuda.synchronize()

        def check():
            ws.raise_if_failed()
            for M in MIXED_SIZES:
                assert torch.equal(last[M].residual, refs[M].residual), f"M={M}: residual differs"
                assert torch.equal(last[M].allreduce, refs[M].allreduce), f"M={M}: allreduce differs"
                eq = (last[M].q.view(torch.uint8) == refs[M].q.view(torch.uint8)).float().mean().item()
                assert eq >= 0.999, f"M={M}: only {eq} of fp8 bytes equal"
        gathered_check(boot, check)
        ws.barrier()


def _poison_free_memory() -> None:
    """Fill what the caching allocator hands out next with 0xA5 bytes: an output the kernel never
    wrote then differs from the other form's instead of keeping a freed tensor's equal bytes."""
    torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(0xA5)


def _body_reducescatter_forms_agree() -> None:
    """Every reduce-scatter form (NOTE [reduce-scatter rounds]) on RS_CASES, gathered and not (the
    pipelined forms' rows by the row gather's batched form, NOTE [row gather batches]):
    the shard's residual, y, q and scales and the gathered rows bitwise those of the "serial" form
    and of allreduce_add_rmsnorm's rows; then the forms back to back (with the all-reduce between
    them), never synchronized, bitwise the same again; after a reset every form's gathered q and y
    of new inputs are the all-reduce's."""
    import dataclasses

    import distnorm
    from distnorm.collectives import reset
    from distnorm.collectives.state import state_of
    from distnorm.comm import Workspace

    def as_bytes(t):
        return None if t is None else t.contiguous().view(torch.uint8).clone()

    def outputs(out):
        return [as_bytes(t) for t in (out.residual, out.y, out.q, out.scales)]

    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        assert ws.p2p_ok, f"no peer mappings: {ws.fallback_reason}"
        state = state_of(ws)
        default = state.tuning

        def run(form, qname, M, max_ctas, gather, x, res, w, kw):
            # the pipelined forms' rows are gathered in the row gather's batched form
            rows = dict(default.rows_per_cta)
            if form == TMA_R1:
                form, rows["reducescatter"] = TMA_FORM, 1
            state.tuning = dataclasses.replace(
                default, reducescatter_form=form,
                rowgather_form="unit" if form == "serial" else "batched",
                max_ctas={"reducescatter": max_ctas} if max_ctas else {}, rows_per_cta=rows)
            a, b = distnorm.shard_rows(M, ws)
            _poison_free_memory()
            return distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6, workspace=ws,
                                                       norm_out=True, gather=gather, **kw)

        def check():
            for seed, (qname, M, max_ctas) in enumerate(RS_CASES):
                kw, _ = quant_kwargs(qname)
                x, res, w = make_inputs(M, H, ws.rank, 90 + seed, world=ws.world_size)
                want = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws,
                                                      norm_out=True, **kw)
                a, b = distnorm.shard_rows(M, ws)
                # a row stride other than H: the TMA form's rank pushes with thread stores
                strided = torch.empty(M, H + 64, dtype=x.dtype, device=x.device)[:, :H]
                strided.copy_(x)
                for gather in (False, True):
                    got = {form: outputs(run(form, qname, M, max_ctas, gather, x, res, w, kw))
                           for form in RS_VARIANTS}
                    if TMA_FORM in RS_FORMS:
                        got[TMA_FORM + " strided"] = outputs(run(TMA_FORM, qname, M, max_ctas,
                                                                 gather, strided, res, w, kw))
                    if ROLES_FORM in RS_FORMS:  # NOTE [reduce-scatter roles by TMA]: thread stores
                        got[ROLES_FORM + " strided"] = outputs(run(ROLES_FORM, qname, M, max_ctas,
                                                                   gather, strided, res, w, kw))
                    torch.cuda.synchronize()
                    ws.raise_if_failed()
                    what = f"{qname} M={M} max_ctas={max_ctas} gather={gather}"
                    for form in list(got)[1:]:
                        for name, p, q in zip(("residual", "y", "q", "scales"),
                                              got[form], got[RS_FORMS[0]]):
                            assert (p is None) == (q is None) and (p is None or torch.equal(p, q)), \
                                f"{what}: {form} {name} differs from the serial form's"
                    h, y = got[RS_FORMS[-1]][:2]
                    assert torch.equal(h, as_bytes(want.residual[a:b])), f"{what}: residual"
                    rows = slice(None) if gather else slice(a, b)
                    assert torch.equal(y, as_bytes(want.y[rows])), f"{what}: y"
            # back to back: both forms and the all-reduce, nothing synchronized in between
            qname, M, max_ctas = RS_CASES[0]
            kw, _ = quant_kwargs(qname)
            x, res, w = make_inputs(M, H, ws.rank, 99, world=ws.world_size)
            last = {}
            nforms = len(RS_FORMS)
            for i in range(14 * nforms):
                form = RS_FORMS[i % nforms]
                # the forms' last calls (one per form) gather alike: their outputs compare
                last[form] = run(form, qname, M, max_ctas, (i // nforms) % 3 == 0, x, res, w, kw)
                if i % 5 == 4:
                    distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, **kw)
            torch.cuda.synchronize()
            ws.raise_if_failed()
            first, *others = [outputs(last[form]) for form in RS_FORMS]
            assert all(p is None and q is None or torch.equal(p, q)
                       for shard in others for p, q in zip(shard, first)), \
                "back to back: the forms' outputs differ"
            # after a reset (barrier epochs zeroed) gathered rows of new inputs are the
            # all-reduce's again
            reset(ws)
            qname, M, max_ctas = RS_CASES[1]
            kw, _ = quant_kwargs(qname)
            x, res, w = make_inputs(M, H, ws.rank, 98, world=ws.world_size)
            want = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, norm_out=True,
                                                  **kw)
            for form in RS_FORMS:
                got = outputs(run(form, qname, M, max_ctas, True, x, res, w, kw))
                torch.cuda.synchronize()
                ws.raise_if_failed()
                assert torch.equal(got[2], as_bytes(want.q)), f"after reset: {form} q"
                assert torch.equal(got[1], as_bytes(want.y)), f"after reset: {form} y"
        try:
            gathered_check(boot, check)
        finally:
            state.tuning = default
        ws.barrier()


def kernel_keys(test: str, params: dict) -> list[tuple]:
    """The kernels these tests launch (tests/conftest.py compiles them ahead)."""
    import dataclasses

    from allreduce_cases import launched_key, scatter_keys
    from distnorm.collectives.plan import Tuning
    from distnorm.launch.spawn import launch_world_size

    world = launch_world_size()
    if world < 2:
        return []
    keys = []

    def key(algo, form, spec, M, residual, write_y, write_ar):
        tuning = Tuning.from_env()
        if algo in ALGORITHM_FORMS:
            tuning = dataclasses.replace(tuning, **{f"{algo}_form": form})
        return launched_key(world, algo, M, H, spec, residual, write_y, write_ar, tuning=tuning)
    if test == "test_forms_agree":
        algo = params["algo"]
        for form in ALGORITHM_FORMS[algo]:
            for qname, M in CASES:
                if M == "cap+1":
                    M = algo_capacity_rows(algo, world, H, quant_spec(qname)) + 1
                keys.append(key(algo, form, quant_spec(qname), M, True, True, True))
                if qname == "none":
                    keys.append(key(algo, form, None, M, False, False, True))
    if test == "test_reducescatter_forms_agree":  # gathered and not; the all-reduce it matches
        for form in RS_VARIANTS:
            tuning = Tuning.from_env()
            rows = dict(tuning.rows_per_cta)
            if form == TMA_R1:
                form, rows["reducescatter"] = TMA_FORM, 1
            tuning = dataclasses.replace(tuning, reducescatter_form=form, rows_per_cta=rows)
            keys += [k for qname, M, _ in RS_CASES
                     for k in scatter_keys(world, M, H, quant_spec(qname), (True,), tuning)]
        keys += [launched_key(world, "auto", M, H, quant_spec(qname), True, True, False)
                 for qname, M, _ in RS_CASES]
    if test == "test_forms_mixed_back_to_back":
        for algo in dict.fromkeys(MIXED_ALGOS):
            for form in ALGORITHM_FORMS.get(algo, ("",)):
                keys += [key(algo, form, quant_spec(MIXED_FORMAT), M, True, True, True)
                         for M in MIXED_SIZES]
    return list(dict.fromkeys(keys))


@pytest.mark.parametrize("algo", list(ALLREDUCE_FORMS))
def test_forms_agree(algo):
    run_distributed(_body_forms_agree, algo, timeout_s=TIMEOUT_S)


def test_reducescatter_forms_agree():
    run_distributed(_body_reducescatter_forms_agree, timeout_s=TIMEOUT_S)


def test_forms_mixed_back_to_back():
    run_distributed(_body_mixed_back_to_back, MIXED_CALLS, timeout_s=TIMEOUT_S)
