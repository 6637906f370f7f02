"""Host time of one eager all-reduce call: microseconds a CPU-bound caller pays to launch
`allreduce_add_rmsnorm` (static FP8, M = 1, H = 4096; outputs passed / allocated), plain
`allreduce`, and the single-GPU `add_rmsnorm` beside them, three rounds each (no sync between calls).

    torchrun --nproc-per-node 2 benchmarks/host_time_allreduce.py [--profile]

With ranks sharing one GPU (DISTNORM_SHARE_GPUS=1) the kernels time-slice, but what is measured is
the host side (the calls stay below the launch queue's depth). --profile prints rank 0's cProfile
of the passed-outputs call.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_us_per_call  # noqa: E402

import distnorm  # noqa: E402
from distnorm.comm import Workspace  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402

CALLS = 300  # per round: well below the launch queue's depth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    env = init_distributed()
    ws = Workspace(buffer_bytes=32 << 20)
    H = 4096
    x = torch.randn(1, H, device="cuda").bfloat16()
    r = torch.randn(1, H, device="cuda").bfloat16()
    w = torch.ones(H, device="cuda").bfloat16()
    s = torch.tensor([0.05], device="cuda")
    out = distnorm.allreduce_add_rmsnorm(x, r, w, 1e-6, workspace=ws, quant="fp8", scale=s)
    cases = {
        "allreduce_fp8_outputs_passed": lambda: distnorm.allreduce_add_rmsnorm(
            x, r, w, 1e-6, workspace=ws, quant="fp8", scale=s, residual_out=out.residual, q_out=out.q),
        "allreduce_fp8_allocating": lambda: distnorm.allreduce_add_rmsnorm(
            x, r, w, 1e-6, workspace=ws, quant="fp8", scale=s),
        "allreduce_plain": lambda: distnorm.allreduce(x, workspace=ws),
        "single_gpu_fp8_outputs_passed": lambda: distnorm.add_rmsnorm(
            x, r, w, 1e-6, quant="fp8", scale=s, residual_out=out.residual, q_out=out.q),
    }
    rounds = {name: [round(host_us_per_call(fn, CALLS, warmup=50), 2) for _ in range(3)]
              for name, fn in cases.items()}
    if env.rank == 0:
        print(f"host us per call, 3 rounds, world {ws.world_size}:", rounds, flush=True)
    if args.profile:  # every rank makes the same calls; rank 0 profiles its own
        prof = cProfile.Profile()
        fn = cases["allreduce_fp8_outputs_passed"]
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        if env.rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
    torch.cuda.synchronize()
    ws.close()


if __name__ == "__main__":
    main()
