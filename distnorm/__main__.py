"""`python -m distnorm` (or `distnorm`): check every fused op on the visible GPU against the reference
and print a timing table. Without a GPU it runs the reference path on the CPU and says so."""
from __future__ import annotations

import argparse
import time

import torch

def _time_us(fn, device) -> float:
    if device == "cpu":
        fn()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        return (time.perf_counter() - t) / 5 * 1e6
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / 100


def main(argv=None) -> int:
    import distnorm
    from distnorm.formats import FORMATS, format_variants
    from distnorm.reference import add_rmsnorm_ref

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-m", "--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no CUDA GPU visible: running the reference path on the CPU (kernels are not exercised)")
    else:
        print(f"GPU: {torch.cuda.get_device_name()}")
    M, H = args.tokens, args.hidden
    torch.manual_seed(0)
    x = torch.randn(M, H, device=device).to(torch.bfloat16)
    res = torch.randn(M, H, device=device).to(torch.bfloat16)
    w = (torch.rand(H, device=device) + 0.5).to(torch.bfloat16)
    scalars = {"scale": torch.tensor([0.05], device=device),       # the float32 [1] argument a
               "global_scale": torch.tensor([200.0], device=device)}  # format takes (FORMATS.scalar)
    print(f"{'variant':28s} {'check':>6s} {'match %':>8s} {'us':>8s}   (M={M}, H={H}, bf16)")
    failures = 0
    for name, quant, opts in format_variants():
        scalar = FORMATS[quant or "none"].scalar
        kw = dict(quant=quant, **opts, **({scalar: scalars[scalar]} if scalar else {}))
        out = distnorm.add_rmsnorm(x, res, w, 1e-6, **kw)
        ref = add_rmsnorm_ref(x, res, w, 1e-6, **kw)
        ok = torch.equal(out.residual, ref.residual)
        if quant is None:
            match = (out.y == ref.y).float().mean().item()
        else:
            match = (out.q.view(torch.uint8) == ref.q.view(torch.uint8)).float().mean().item()
        ok = ok and match >= 0.999
        failures += not ok
        us = _time_us(lambda: distnorm.add_rmsnorm(x, res, w, 1e-6, **kw), device)
        print(f"{name:28s} {'ok' if ok else 'FAIL':>6s} {100 * match:8.3f} {us:8.2f}")
    print("all ops match the reference" if not failures else f"{failures} op(s) differ from the reference")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
