"""Cross-rank CTA barrier latency: time of N barrier rounds in one kernel / N.

    torchrun --nproc-per-node 2 benchmarks/bench_barrier.py --out barrier.json

For 1 and 8 CTAs (and --ctas to change), mode barrier_only (pure barrier) and check (each round
also writes a slot and reads every peer's slot). Per (mode, ctas): median over --repeats of
(kernel time / rounds) on each rank, then the max over ranks. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # tests/barrier_kernel.py: the kernel timed here

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--ctas", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args()

    from distnorm.comm import Workspace, resolve_bootstrap
    from barrier_kernel import launch_barrier_rounds, run_barrier_rounds
    from distnorm.launch import init_distributed

    init_distributed()
    boot = resolve_bootstrap(None)
    rows = []
    with Workspace(buffer_bytes=16 << 20, signal_bytes=1 << 20) as ws:
        if not ws.p2p_ok:
            raise SystemExit(f"no peer mappings: {ws.fallback_reason}")
        for mode in ("barrier_only", "check"):
            bo = mode == "barrier_only"
            for ctas in args.ctas:
                assert run_barrier_rounds(ws, 100, ctas=ctas, timeout_s=30, barrier_only=bo) == 0
                times = []
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                for _ in range(args.repeats):
                    ws.barrier()  # start together; launch skew is amortized over the rounds
                    start.record()
                    out = launch_barrier_rounds(ws, args.rounds, ctas=ctas, timeout_s=30, barrier_only=bo)
                    end.record()
                    end.synchronize()
                    ws.raise_if_failed()
                    assert int(out.item()) == 0, "barrier check found mismatches"
                    times.append(start.elapsed_time(end) * 1000.0 / args.rounds)
                med = statistics.median(times)
                per_rank = boot.all_gather_object(med)
                rows.append({"mode": mode, "ctas": ctas, "rounds": args.rounds, "repeats": args.repeats,
                             "us_per_round_max_over_ranks": max(per_rank),
                             "us_per_round_per_rank": per_rank})
        ws.barrier()
    if boot.rank == 0:
        name = torch.cuda.get_device_name()
        print(f"cross-rank CTA barrier, {boot.world_size} x {name}, {args.rounds} rounds/kernel, "
              f"median of {args.repeats}, max over ranks")
        print(f"{'mode':<14}{'ctas':>6}{'us/round':>12}")
        for r in rows:
            print(f"{r['mode']:<14}{r['ctas']:>6}{r['us_per_round_max_over_ranks']:>12.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world_size": boot.world_size, "device": name, "results": rows}, f, indent=2)
    from distnorm.launch import cleanup
    cleanup()


if __name__ == "__main__":
    main()
