"""The local part of the all-reduce without peer memory, on one GPU: what a rank does with the
rows NCCL gathered for it ([N, M, H]: N ranks' rows), before and after the slots kernel.

    torch+kernel  float32 sum of the N slots in torch, h = T(acc + res), then the single-GPU
                  kernel on h (rowsplit.slice_epilogue: what the fallback did)
    slots         the single-GPU kernel with N slots (collectives/nopeer.fold_epilogue: one pass)

    python benchmarks/bench_fold.py --out benchmarks/results/fold_h200

fp8_per_token with a residual. CUDA graph (common.time_graph_us), median; input sets rotate so
that at least 256 MB are touched per round (the inputs do not sit in the 50 MB L2). Writes
<out>.md and <out>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
from common import time_graph_us, write_table  # noqa: E402

from distnorm.args import allocate_outputs  # noqa: E402
from distnorm.collectives.nopeer import fold_epilogue  # noqa: E402
from distnorm.collectives.rowsplit import fold_slices, slice_epilogue  # noqa: E402
from distnorm.formats import make_quant_spec  # noqa: E402

QUANT = "fp8_per_token"


def _case(N: int, M: int, H: int) -> dict:
    spec = make_quant_spec(QUANT)
    w = torch.rand(H, device="cuda").to(torch.bfloat16) + 0.5
    footprint = (N + 2) * M * H * 2 + M * H
    sets = max(1, min(64, -(-(256 << 20) // footprint)))
    data = []
    for _ in range(sets):
        parts = torch.randn(N, M, H, device="cuda").to(torch.bfloat16)
        res = torch.randn(M, H, device="cuda").to(torch.bfloat16)
        outs = allocate_outputs(parts[0], spec, True, False, None, None, None, None)
        data.append((parts, res, outs))
    turn = [0]

    def old():
        parts, res, _ = data[turn[0] % sets]
        turn[0] += 1
        slice_epilogue(fold_slices(parts, M), torch.bfloat16, res, w, 1e-6, spec, None, None,
                       False, False, False)

    def new():
        parts, res, outs = data[turn[0] % sets]
        turn[0] += 1
        fold_epilogue(parts, res, w, 1e-6, spec, None, None, False, *outs)

    calls = max(20, sets)
    row = {"N": N, "M": M, "H": H, "sets": sets}
    for name, fn in (("torch+kernel", old), ("slots", new)):
        row[name] = time_graph_us(fn, calls_per_graph=calls)
    nbytes = footprint
    row["slots TB/s"] = nbytes / row["slots"] / 1e6
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--Ns", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--Ms", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    ap.add_argument("--Hs", type=int, nargs="+", default=[4096, 8192])
    args = ap.parse_args()
    rows = [_case(N, M, H) for H in args.Hs for N in args.Ns for M in args.Ms]
    dev = torch.cuda.get_device_name()
    cmd = "python benchmarks/bench_fold.py " + " ".join(sys.argv[1:])
    lines = [f"# No-peer all-reduce, local part: {dev}", "",
             f"Command: `{cmd}`; torch {torch.__version__}; {QUANT} with a residual; us per call "
             "(CUDA graph, median); M = rows folded (the rank's slice, or all rows in the gather "
             "form).", "",
             "| N | M | H | sets | torch+kernel us | slots us | speedup | slots TB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['N']} | {r['M']} | {r['H']} | {r['sets']} | {r['torch+kernel']:.2f} | "
                     f"{r['slots']:.2f} | {r['torch+kernel'] / r['slots']:.2f}x | "
                     f"{r['slots TB/s']:.2f} |")
    write_table(args.out, "\n".join(lines) + "\n", {"device": dev, "command": cmd, "rows": rows})


if __name__ == "__main__":
    main()
