"""The TP example (examples/tp_llama.py) on GPUs: Llama-3-8B layer shapes, the three forms (plain
torch with NCCL, distnorm.tp, torch.compile + distnorm's fusion pass) agree after two layers, the
pass fuses exactly two sites per layer, and a distnorm.tp decode step replays in a CUDA graph with
the eager result."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from harness import MULTIGPU_MARKS, gathered_check
from distnorm.launch import run_distributed

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(_ROOT, "examples"), os.path.join(_ROOT, "tests")]

pytestmark = MULTIGPU_MARKS
BOUNDS = {False: 2e-2, True: 6e-2}  # as tests/test_tp_cpu.py


def _body(fp8: bool, decode: bool) -> None:
    from dataclasses import replace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch.distributed as dist

    import distnorm
    from distnorm.comm import resolve_bootstrap
    from tp_llama import MODELS, Config, DecoderStack, compare_forms, make_inputs

    boot = resolve_bootstrap(None)
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = replace(Config(**MODELS["8b"]), fp8=fp8)
    with distnorm.Workspace(dist.group.WORLD) as ws:
        def check():
            got = compare_forms(cfg, 2, 32 if decode else 2048, decode, ws, device)
            print(f"\n[tp] fp8={fp8} decode={decode}: {got}", flush=True)
            assert len(got["sites"]) == 4 and not got["skipped"], got
            assert got["rel_distnorm"] < BOUNDS[fp8] and got["rel_pass"] < BOUNDS[fp8], got
            # the sequence-parallel stack: within the bound here (the fused SDPA kernels' output
            # may differ in the last bit from run to run on GPUs, below), bitwise on the CPU
            assert got["rel_seqpar"] < BOUNDS[fp8], got
            if decode:  # a decode step of the distnorm.tp form in a CUDA graph
                model = DecoderStack(cfg, 2, "distnorm", ws, device)
                a, residual, caches = make_inputs(cfg, 8, True, 2, device)
                # the math attention: the fused SDPA kernels' decode output differs from run to run
                # in the last bit (seen on an H200, torch 2.11), which a bitwise check would blame
                # on the graph
                with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
                    want = model(a, residual.clone(), caches)[1]
                    static_res = residual.clone()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = model(a, static_res, caches)[1]
                    for _ in range(3):
                        graph.replay()
                    torch.cuda.synchronize()
                assert torch.equal(out, want), "graph replay differs from the eager step"
        gathered_check(boot, check)


@pytest.mark.parametrize("fp8, decode", [(False, True), (True, True), (True, False)])
def test_tp_example_on_gpus(fp8, decode):
    run_distributed(_body, fp8, decode, timeout_s=900)
