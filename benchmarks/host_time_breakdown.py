"""Host time of one eager single-GPU call and of its pieces (M = 1, H = 4096, static FP8, one
process, no synchronization between calls): the whole call with outputs passed / allocated, the
compiled kernel called alone through TVM-FFI (the floor), and the Python steps of the eager path.

    python benchmarks/host_time_breakdown.py [--rounds 2]

Results: benchmarks/README.md (single GPU, host time).
"""
import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from common import host_us_per_call  # noqa: E402

import distnorm  # noqa: E402
from distnorm import ops  # noqa: E402
from distnorm.args import allocate_outputs  # noqa: E402
from distnorm.formats import make_quant_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    H = 4096
    x = torch.randn(1, H, device="cuda").bfloat16()
    r = torch.randn_like(x)
    w = torch.ones(H, device="cuda").bfloat16()
    s = torch.tensor([0.05], device="cuda")
    out = distnorm.add_rmsnorm(x, r, w, 1e-6, quant="fp8", scale=s)
    spec = make_quant_spec("fp8")
    kernels = ops._call_kernels(x.dtype, H, spec, True, False, False, ops._rows_bucket(1))
    kernel = kernels.kernel or kernels.compile(False)
    cases = {
        "add_rmsnorm, outputs passed": lambda: distnorm.add_rmsnorm(
            x, r, w, 1e-6, quant="fp8", scale=s, residual_out=out.residual, q_out=out.q),
        "add_rmsnorm, allocating": lambda: distnorm.add_rmsnorm(x, r, w, 1e-6, quant="fp8",
                                                               scale=s),
        "kernel alone (TVM-FFI entry)": lambda: kernel(x, r, out.residual, w, None, out.q, None, s,
                                                       None, 1e-6),
        "format + kernels lookup": lambda: ops._eager_kernels(
            "fp8", 128, "swizzled", "row", False, x.dtype, H, True, False, False, 1),
        "allocate_outputs, passed, unchecked": lambda: allocate_outputs(
            x, spec, True, False, out.residual, None, out.q, None, check_given=False),
        "allocate_outputs, allocating": lambda: allocate_outputs(
            x, spec, True, False, None, None, None, None, check_given=False),
        "torch.compiler.is_compiling": torch.compiler.is_compiling,
    }
    for i in range(args.rounds):
        for name, fn in cases.items():
            print(f"round {i + 1}  {name:38s} {host_us_per_call(fn, 3000, warmup=200):7.2f} us",
                  flush=True)


if __name__ == "__main__":
    main()
