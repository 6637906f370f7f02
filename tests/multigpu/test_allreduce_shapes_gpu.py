"""Multi-GPU tests of the fused all-reduce kernels at activation dtypes and hidden sizes the grids
of test_allreduce_gpu.py do not build (its docstring says how to run them; the same launchers, the
same checks: tests/multigpu/allreduce_cases.py).
"""
from __future__ import annotations

import os
import sys

import torch

from allreduce_cases import (ALGOS, BUFFER_BYTES, FULL, TIMEOUT_S, checked_on_every_rank,
                             group_bootstrap, launched_key, make_inputs, one_case_keys, quant_spec)
from harness import MULTIGPU_MARKS, gathered_check
from distnorm.launch import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # quant_check

pytestmark = MULTIGPU_MARKS


FP16_QUANTS = ("none", "fp8_per_token", "nvfp4")
MODEL_QUANTS = ("none", "fp8_per_token", "nvfp4")
MODEL_SIZES = (896, 2880, 5376)
ROWS = (1, 300)


def _model_cases():
    """(algo, format, H) of the model-size test: each pair at one of the sizes, all three with
    DISTNORM_FULL=1 (a kernel compiles per algorithm, format and size)."""
    for i, algo in enumerate(ALGOS):
        for j, qname in enumerate(MODEL_QUANTS):
            k = (i + j) % len(MODEL_SIZES)
            for H in MODEL_SIZES if FULL else MODEL_SIZES[k:k + 1]:
                yield algo, qname, H


def _body_fp16() -> None:
    """fp16 activations through every algorithm (the grids run bf16). The kernels move fp16 rows
    as packed words and widen both halves of each word (NormQuantCore.word_values), so a half
    taken from the wrong word or position shows here."""
    from distnorm.comm import Workspace
    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        for algo in ALGOS:
            for qname in FP16_QUANTS:
                for M in ROWS:
                    checked_on_every_rank(boot, ws, f"fp16 {algo} {qname} M={M}", algo, qname,
                                           M, 4096, 9000 + M, torch.float16)
        ws.barrier()


def _body_model_sizes() -> None:
    """Hidden sizes of released models whose row tilings the grids never build: 896 (Qwen2.5-0.5B)
    and 2880 (gpt-oss) leave a ragged tail of vectors, 5376 (Gemma 3 27B) has 3 vectors per
    thread; every algorithm and three formats, each pair at one of the sizes (all three with
    DISTNORM_FULL=1: a kernel compiles per algorithm, format and size), 1 and 300 rows."""
    from distnorm.comm import Workspace
    boot = group_bootstrap()
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        for algo, qname, H in _model_cases():
            for M in ROWS:
                checked_on_every_rank(boot, ws, f"{algo} {qname} M={M} H={H}", algo, qname, M, H,
                                       7000 + H + M)
        ws.barrier()


IN_PLACE_ROWS = (1, 300, 3000)  # lamport's one launch, two-shot's sized forms, lamport in chunks


def _body_in_place() -> None:
    """vLLM's in-place form through every algorithm: residual_out=residual and y_out=x (the normed
    rows written over this rank's partial sums) give the bytes of the same call with outputs of
    their own; a CTA writing rows over x that another has yet to push to the peers shows here."""
    from distnorm.collectives import allreduce_add_rmsnorm
    from distnorm.comm import Workspace
    boot = group_bootstrap()
    kw = dict(quant="fp8_per_token", norm_out=True)
    with Workspace(buffer_bytes=BUFFER_BYTES) as ws:
        def check():
            for algo in ALGOS:
                for M in IN_PLACE_ROWS:
                    x, res, w = make_inputs(M, 4096, ws.rank, 4100 + M, world=ws.world_size)
                    want = allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, algo=algo, **kw)
                    xi, ri = x.clone(), res.clone()
                    got = allreduce_add_rmsnorm(xi, ri, w, 1e-6, workspace=ws, algo=algo,
                                                residual_out=ri, y_out=xi, **kw)
                    torch.cuda.synchronize()
                    assert got.residual.data_ptr() == ri.data_ptr()
                    assert got.y.data_ptr() == xi.data_ptr()
                    for name in ("residual", "y", "q", "scales"):
                        a, b = getattr(got, name), getattr(want, name)
                        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                            f"{algo} M={M} {name}: in place differs from outputs of its own"
        gathered_check(boot, check)
        ws.barrier()


def kernel_keys(test: str, params: dict) -> list[tuple]:
    """The kernels of both tests (distnorm.kernels.precompile keys): tests/conftest.py compiles
    them ahead, spread over the ranks, instead of one at a time inside the tests (about 40 s of
    each rank's suite on 2 x H200). A key missed here is compiled where it is used."""
    from distnorm.launch.spawn import launch_world_size
    world = launch_world_size()
    if world < 2:
        return []
    if test == "test_fp16_activations":
        cases = [(algo, qname, 4096, torch.float16) for algo in ALGOS for qname in FP16_QUANTS]
    elif test == "test_model_hidden_sizes":
        cases = [(algo, qname, H, torch.bfloat16) for algo, qname, H in _model_cases()]
    elif test == "test_in_place_outputs":
        spec = quant_spec("fp8_per_token")
        return list(dict.fromkeys(launched_key(world, algo, M, 4096, spec, True, True, False)
                                  for algo in ALGOS for M in IN_PLACE_ROWS))
    else:
        return []
    return list(dict.fromkeys(key for algo, qname, H, dtype in cases for M in ROWS
                              for key in one_case_keys(world, algo, qname, M, H, dtype)))


def test_fp16_activations():
    run_distributed(_body_fp16, timeout_s=TIMEOUT_S)


def test_model_hidden_sizes():
    run_distributed(_body_model_sizes, timeout_s=TIMEOUT_S)


def test_in_place_outputs():
    run_distributed(_body_in_place, timeout_s=TIMEOUT_S)
