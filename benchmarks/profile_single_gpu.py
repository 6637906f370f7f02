"""Profile the single-GPU fused kernel under Nsight Compute, one launch per case, and the host
time of an eager call under cProfile.

    ncu --profile-from-start off --csv --page raw --metrics <list> \
        python benchmarks/profile_single_gpu.py --cases fp8:1:4096 nvfp4:1024:4096 > ncu.csv
    python benchmarks/profile_single_gpu.py --host        # cProfile of 20000 eager calls

A case is variant:M:H with the variants of bench_single_gpu.py. Only the profiled launch sits
between cudaProfilerStart/Stop (compilation and input creation stay outside).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_single_gpu import VARIANTS, _input_set  # noqa: E402

import distnorm  # noqa: E402


def case_call(variant: str, M: int, H: int):
    quant, opts = VARIANTS[variant]
    kw = dict(quant=quant, **opts)
    if quant == "fp8":
        kw["scale"] = torch.tensor([0.05], device="cuda")
    if quant == "nvfp4":
        kw["global_scale"] = torch.tensor([200.0], device="cuda")
    w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    x, r, outs = _input_set(M, H, w, kw)
    return lambda: distnorm.add_rmsnorm(x, r, w, 1e-6, **kw, **outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=[])
    ap.add_argument("--host", action="store_true")
    args = ap.parse_args()
    for case in args.cases:
        v, M, H = case.split(":")
        call = case_call(v, int(M), int(H))
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("case", case, file=sys.stderr)
    if args.host:
        host_breakdown()


def _per_call_us(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def host_breakdown() -> None:
    """Host microseconds per eager call (M=1, H=4096, static fp8), whole and in pieces."""
    from distnorm import ops
    from distnorm.formats import kernel_spec, make_quant_spec
    from distnorm.kernels.compile import compiled_fused_norm
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    r, w = torch.randn_like(x), torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([0.05], device="cuda")
    out = distnorm.add_rmsnorm(x, r, w, 1e-6, quant="fp8", scale=s)
    spec = make_quant_spec("fp8")
    kernel = compiled_fused_norm("bfloat16", 4096, kernel_spec(spec), True, False, False, 1)
    qv = out.q.view(torch.int32)
    pieces = {
        "add_rmsnorm, outputs passed": lambda: distnorm.add_rmsnorm(
            x, r, w, 1e-6, quant="fp8", scale=s, residual_out=out.residual, q_out=out.q),
        "add_rmsnorm, allocating": lambda: distnorm.add_rmsnorm(x, r, w, 1e-6, quant="fp8", scale=s),
        "compiled kernel alone (TVM-FFI)": lambda: kernel(x, r, out.residual, w, None, qv, None, s,
                                                          None, 1e-6),
        "kernel with q.view(int32)": lambda: kernel(x, r, out.residual, w, None,
                                                    out.q.view(torch.int32), None, s, None, 1e-6),
        "run_fused_norm_kernel": lambda: ops.run_fused_norm_kernel(
            x, r, w, 1e-6, spec, s, None, False, out.residual, None, out.q, None),
        "torch.empty(1, 4096) x2": lambda: (torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda"),
                                            torch.empty(1, 4096, dtype=torch.float8_e4m3fn, device="cuda")),
    }
    for name, fn in pieces.items():
        print(f"host us per call: {_per_call_us(fn):6.2f}  {name}")
    prof = cProfile.Profile()
    fn = pieces["add_rmsnorm, outputs passed"]
    prof.enable()
    for _ in range(20000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)

if __name__ == "__main__":
    main()
