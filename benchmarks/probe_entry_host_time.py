"""Host time of the single-GPU kernel's compiled entry with the same tensor objects every call vs
fresh views / slices / allocated outputs, and of making those alone (M = 1, H = 4096, static FP8,
3000 calls, two rounds): where an eager call's host time goes.

    python benchmarks/probe_entry_host_time.py

Results: benchmarks/results/allreduce_host_time_shared_h200.md (run on nvidia-h200, 2026-11-24).
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from common import host_us_per_call  # noqa: E402

import distnorm  # noqa: E402
from distnorm.args import kernel_scalars  # noqa: E402
from distnorm.formats import make_quant_spec  # noqa: E402
from distnorm.ops import _call_kernels, _rows_bucket  # noqa: E402


def timed(name, fn, n=3000):
    print(f"{name:44s} {host_us_per_call(fn, n, warmup=200):7.2f} us")


def main() -> None:
    print("torch", torch.__version__, "| __dlpack_c_exchange_api__:",
          hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
    cache = os.path.expanduser(os.environ.get("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi"))
    print("tvm-ffi cache:", os.listdir(cache) if os.path.isdir(cache) else "none")
    M, H = 1, 4096
    x = torch.randn(M, H, device="cuda").bfloat16()
    r = torch.randn(M, H, device="cuda").bfloat16()
    w = torch.ones(H, device="cuda").bfloat16()
    s = torch.tensor([0.05], device="cuda")
    out = distnorm.add_rmsnorm(x, r, w, 1e-6, quant="fp8", scale=s)
    kernels = _call_kernels(x.dtype, H, make_quant_spec("fp8"), True, False, False, _rows_bucket(M))
    k, ro, q = kernels.kernel, out.residual, out.q
    sc = kernel_scalars(kernels.scalar, s, None)
    for _ in range(2):
        timed("kernel, same tensor objects", lambda: k(x, r, ro, w, None, q, None, *sc, 1e-6))
        timed("kernel, x as a fresh view", lambda: k(x.view(M, H), r, ro, w, None, q, None, *sc, 1e-6))
        timed("kernel, 4 fresh views", lambda: k(x.view(M, H), r.view(M, H), ro.view(M, H), w, None,
                                                 q.view(M, H), None, *sc, 1e-6))
        timed("kernel, 4 fresh slices [0:M]", lambda: k(x[0:M], r[0:M], ro[0:M], w, None, q[0:M],
                                                        None, *sc, 1e-6))
        timed("4 views alone", lambda: (x.view(M, H), r.view(M, H), ro.view(M, H), q.view(M, H)))
        timed("4 slices alone", lambda: (x[0:M], r[0:M], ro[0:M], q[0:M]))
        timed("kernel, fresh empty_like outputs", lambda: k(x, r, torch.empty_like(ro), w, None,
                                                            torch.empty_like(q), None, *sc, 1e-6))
        timed("2 empty_like alone", lambda: (torch.empty_like(ro), torch.empty_like(q)))
        timed("add_rmsnorm, outputs passed", lambda: distnorm.add_rmsnorm(
            x, r, w, 1e-6, quant="fp8", scale=s, residual_out=ro, q_out=q))


if __name__ == "__main__":
    main()
