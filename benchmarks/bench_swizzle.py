"""The 128x4 swizzle of linear block scales on one GPU (formats.swizzle_into): what the
sequence-parallel gather and the no-peer path pay after their kernels to put gathered NVFP4 /
MXFP scales [M, K] into the layout the GEMM reads.

    bytes     the permuted copy of 1-byte elements (swizzle_into before 2026-11-28)
    words     swizzle_into: the permuted copy of 4-byte words (a tile row's 4 blocks are one word)

    python benchmarks/bench_swizzle.py --out benchmarks/results/swizzle_into_h200

CUDA graph of 20 calls (common.time_graph_us), median; the scales (0.5-16 MB) stay in the
50 MB L2 between calls, as they do after the kernel that wrote them. Writes <out>.md and
<out>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
from common import time_graph_us, write_table  # noqa: E402

from distnorm.formats import swizzle_into, to_swizzled  # noqa: E402


def swizzle_bytes(linear: torch.Tensor, out: torch.Tensor) -> None:
    """The byte copy swizzle_into made before it moved words (whole tiles only)."""
    M, K = linear.shape
    dst = out.view(torch.uint8).view(M // 128, K // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    dst.copy_(linear.view(torch.uint8).reshape(M // 128, 4, 32, K // 4, 4))


def _case(M: int, K: int) -> dict:
    lin = torch.randint(0, 256, (M, K), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    want = to_swizzled(lin).view(torch.uint8)
    row = {"M": M, "K": K, "MB": M * K / 1e6}
    for name, fn in (("bytes", swizzle_bytes), ("words", swizzle_into)):
        out = torch.full((M, K), 0xA5, dtype=torch.uint8, device="cuda").view(lin.dtype)
        fn(lin, out)
        if not torch.equal(out.view(torch.uint8), want):
            raise AssertionError(f"{name}: {M} x {K} scales differ from to_swizzled's")
        row[name] = time_graph_us(lambda: fn(lin, out))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--Ms", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--Ks", type=int, nargs="+", default=[256, 512],
                    help="blocks per row (NVFP4: H / 16: 256 and 512 for H 4096 and 8192)")
    args = ap.parse_args()
    rows = [_case(M, K) for K in args.Ks for M in args.Ms]
    dev = torch.cuda.get_device_name()
    cmd = "python benchmarks/bench_swizzle.py " + " ".join(sys.argv[1:])
    lines = [f"# 128x4 scale swizzle (formats.swizzle_into): {dev}", "",
             f"Command: `{cmd}`; torch {torch.__version__}; us per call (CUDA graph, median); "
             "both columns checked against to_swizzled's bytes.", "",
             "| M | K | MB | bytes us | words us | speedup |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['M']} | {r['K']} | {r['MB']:.2f} | {r['bytes']:.2f} | "
                     f"{r['words']:.2f} | {r['bytes'] / r['words']:.2f}x |")
    write_table(args.out, "\n".join(lines) + "\n", {"device": dev, "command": cmd, "rows": rows})


if __name__ == "__main__":
    main()
