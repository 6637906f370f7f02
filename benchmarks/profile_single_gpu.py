"""Profile the single-GPU fused kernel under Nsight Compute, one launch per case, and the host
time of an eager call.

    ncu --profile-from-start off --csv --page raw --metrics $(python benchmarks/profile_single_gpu.py --metrics) \
        python benchmarks/profile_single_gpu.py --cases fp8:1:4096 nvfp4:1024:4096 > ncu.csv
    python benchmarks/profile_single_gpu.py --table ncu.csv fp8:1:4096 nvfp4:1024:4096   # one line per case
    python benchmarks/profile_single_gpu.py --host     # host us per eager call, whole and in pieces

Per SASS instruction (one case): `ncu --profile-from-start off --section SourceCounters --section
WarpStateStats -o rep python benchmarks/profile_single_gpu.py --cases nvfp4:1024:4096`, then
`ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv` and
`python benchmarks/profile_single_gpu.py --source src.csv` (opcode mix, stall reasons, hot lines).

A case is variant:M:H with the variants of bench_single_gpu.py, or compiled_<variant>:M:H for the
static-shape torch.compile baseline on the same inputs (rows then labelled by kernel name when a
case launches more than one kernel). Only the profiled launch sits
between cudaProfilerStart/Stop (compilation and input creation stay outside); ncu flushes the
caches before it, so it reads from HBM.
"""
from __future__ import annotations

import argparse
import cProfile
import csv
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_single_gpu import _input_set, decode_fp8_case, variant_kwargs  # noqa: E402
from common import host_us_per_call  # noqa: E402

import distnorm  # noqa: E402


# (ncu metric, column): time, DRAM use, launch shape, registers and occupancy, issue use,
# instructions, and the stall reasons per issued instruction
METRICS = [("gpu__time_duration.sum", "us"),
           ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram%"),
           ("dram__bytes_read.sum", "dram rd"), ("dram__bytes_write.sum", "dram wr"),
           ("launch__registers_per_thread", "regs"), ("launch__grid_size", "grid"),
           ("launch__block_size", "block"), ("launch__cluster_dim_x", "cluster"),
           ("launch__occupancy_limit_registers", "ctas/SM(regs)"),
           ("sm__warps_active.avg.pct_of_peak_sustained_active", "occ%"),
           ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue%"),
           ("sm__inst_executed.sum", "warp inst")] + [
    (f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio", r[:8])
    for r in ("long_scoreboard", "barrier", "membar", "short_scoreboard", "wait", "lg_throttle",
              "math_pipe_throttle", "drain", "mio_throttle")]


def print_table(path: str, cases: list) -> None:
    """One line per profiled launch of an ncu --csv --page raw file, labelled by `cases`."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, units = rows[head], rows[head + 1]
    data = [r for r in rows[head + 2:] if len(r) == len(names)]
    cols = [(names.index(m), label) for m, label in METRICS if m in names]
    print(f"{'case':26}" + "".join(f"{label:>14}" for _, label in cols))
    if len(data) != len(cases):  # a case launched several kernels (a compiled baseline may)
        kernel = names.index("Kernel Name")
        cases = [r[kernel][:25] for r in data]
    for case, r in zip(cases, data):
        cells = []
        for i, _ in cols:
            v = r[i].replace(",", "")
            try:
                f = float(v) / (1000.0 if units[i] == "ns" else 1.0)
                v = f"{f:.3g}" if f < 1e5 else f"{f / 1e6:.2f}M"
            except ValueError:
                pass
            cells.append(f"{v:>14}")
        print(f"{case:26}" + "".join(cells))


def print_source_summary(path: str, top: int = 12) -> None:
    """Summarize an `ncu --page source --csv --print-source sass` export: executed instructions and
    stall samples per opcode, the stall reasons, and the lines with the most samples."""
    import collections
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    names, data = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    i_src, i_inst = names.index("Source"), names.index("Instructions Executed")
    i_samp = names.index("Warp Stall Sampling (All Samples)")
    stalls = [i for i, n in enumerate(names) if n.startswith("stall_") and "Not Issued" not in n]
    inst, samp, why = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        words = [w for w in r[i_src].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        inst[op] += int(r[i_inst] or 0)
        samp[op] += int(r[i_samp] or 0)
        for i in stalls:
            why[names[i][6:]] += int(r[i] or 0)
    n_inst, n_samp = sum(inst.values()), max(1, sum(samp.values()))
    print(f"{n_inst} warp instructions, {n_samp} stall samples")
    print("opcode      inst%  samples%")
    for op, n in inst.most_common(top):
        print(f"{op:10} {100 * n / n_inst:6.1f} {100 * samp[op] / n_samp:8.1f}")
    print("stalls: " + ", ".join(f"{k} {100 * v / n_samp:.1f}%" for k, v in why.most_common(8)))
    for r in sorted(data, key=lambda r: -int(r[i_samp] or 0))[:top]:
        reason = max(stalls, key=lambda i: int(r[i] or 0))
        print(f"{int(r[i_samp]):7} {names[reason][6:]:14} {r[i_src].strip()[:80]}")


def case_call(variant: str, M: int, H: int):
    """One call of a case; variant "compiled_<variant>": the static-shape torch.compile baseline
    (the reference compiled as bench_single_gpu.py compiles it) on the same inputs."""
    compiled = variant.startswith("compiled_")
    variant = variant.removeprefix("compiled_")
    kw = variant_kwargs(variant)
    w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    x, r, outs = _input_set(M, H, w, kw)
    if compiled:
        from distnorm.reference import add_rmsnorm_ref
        fn = torch.compile(add_rmsnorm_ref, dynamic=False)
        return lambda: fn(x, r, w, 1e-6, **kw)
    return lambda: distnorm.add_rmsnorm(x, r, w, 1e-6, **kw, **outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=[])
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--metrics", action="store_true", help="print the ncu metric list and exit")
    ap.add_argument("--source", metavar="CSV", help="summarize an ncu source-page CSV (no GPU)")
    ap.add_argument("--table", nargs="+", metavar=("CSV", "CASE"),
                    help="print an ncu CSV as a table, rows labelled by the cases")
    args = ap.parse_args()
    if args.metrics:
        return print(",".join(m for m, _ in METRICS))
    if args.table:
        return print_table(args.table[0], args.table[1:])
    if args.source:
        return print_source_summary(args.source)
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


def host_breakdown() -> None:
    """Host microseconds per eager call (M=1, H=4096, static fp8), whole and in pieces."""
    from distnorm import ops
    from distnorm.formats import kernel_spec, make_quant_spec
    from distnorm.kernels.compile import compiled_fused_norm
    x, r, w, s, out = decode_fp8_case()
    spec = make_quant_spec("fp8")
    kernel = compiled_fused_norm("bfloat16", 4096, kernel_spec(spec), True, False, False, 1)
    pieces = {
        "add_rmsnorm, outputs passed": lambda: distnorm.add_rmsnorm(
            x, r, w, 1e-6, quant="fp8", scale=s, residual_out=out.residual, q_out=out.q),
        "add_rmsnorm, allocating": lambda: distnorm.add_rmsnorm(x, r, w, 1e-6, quant="fp8", scale=s),
        "compiled kernel alone (TVM-FFI)": lambda: kernel(x, r, out.residual, w, None, out.q, None,
                                                          s, None, 1e-6),
        "kernel-checked path (ops._launch_kernel_checked), outputs passed":
            lambda: ops._launch_kernel_checked(x, r, w, 1e-6, spec, s, None, False, False,
                                               out.residual, None, out.q, None),
        "run_fused_norm_kernel": lambda: ops.run_fused_norm_kernel(
            x, r, w, 1e-6, spec, s, None, False, out.residual, None, out.q, None),
        "Python checks (args.check_op_inputs), skipped on the kernel-checked path":
            lambda: ops.check_op_inputs(x, r, w, spec, s, None, 1e-6),
        "torch.empty_like x2 (the allocating path's outputs)": lambda: (
            torch.empty_like(x), torch.empty_like(x, dtype=torch.float8_e4m3fn)),
    }
    for name, fn in pieces.items():
        print(f"host us per call: {host_us_per_call(fn, 20000, 200):6.2f}  {name}")
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
