"""How many CTAs fill NVLink with pushes into a peer's buffer: threads storing 16-byte units (as the
reduce-scatter's pushes do today) against one thread per CTA issuing TMA bulk copies, from shared
memory only ("tma") or the whole way from HBM through shared memory ("tma-copy")
(tests/push_kernel.py; issue 13's TMA lever: pushes that leave the CTA's threads free).

    torchrun --nproc-per-node 2 benchmarks/bench_push.py --out benchmarks/results/push_h200_x2

Every rank pushes --mib MiB into the next rank's workspace buffer at the same time (both link
directions busy, as in the reduce-scatter); per (mode, CTAs, size): a CUDA graph of --calls
launches, replays queued back to back (common.time_graph_us, prequeue), the median per-launch
time, max over ranks, and GB/s = bytes pushed per launch / that time (one direction). Writes
<out>.md and <out>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # tests/push_kernel.py: the kernel timed here

import torch  # noqa: E402


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--ctas", type=int, nargs="+", default=[4, 8, 16, 32, 66, 132])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)

    from common import time_graph_us, write_table  # benchmarks/common.py
    from push_kernel import CHUNK, MODES, compiled_push

    from distnorm.comm import Workspace, resolve_bootstrap
    from distnorm.launch import cleanup, init_distributed

    init_distributed()
    boot = resolve_bootstrap(None)
    most = max(args.mib) << 20
    rows = []
    with Workspace(buffer_bytes=most, signal_bytes=1 << 20) as ws:
        if not ws.p2p_ok:
            raise SystemExit(f"no peer mappings: {ws.fallback_reason}")
        peer = (ws.rank + 1) % ws.world_size
        src = torch.empty(most, dtype=torch.uint8, device=ws.device).random_(0, 255)
        anchor = torch.zeros(1, dtype=torch.int32, device=ws.device)
        dst = ws.buffer_ptrs_host[peer]
        for mib in args.mib:
            nbytes = (mib << 20) // CHUNK * CHUNK
            row = {"MiB": mib}
            for mode in MODES:
                f = compiled_push(mode)
                for ctas in args.ctas:
                    ws.barrier()  # the ranks' queued replays start together (prequeue)
                    us = time_graph_us(lambda: f(src.data_ptr(), dst, nbytes, ctas, anchor),
                                       calls_per_graph=args.calls, repeats=args.repeats,
                                       prequeue=True)
                    us = max(boot.all_gather_object(us))
                    row[f"{mode}_{ctas}_us"] = round(us, 2)
                    row[f"{mode}_{ctas}_GBs"] = round(nbytes / us / 1e3, 1)
            rows.append(row)
        ws.barrier()
    if boot.rank == 0:
        dev = torch.cuda.get_device_name()
        cmd = (f"torchrun --nproc-per-node {boot.world_size} benchmarks/bench_push.py "
               + " ".join(sys.argv[1:] if argv is None else argv))
        heads = [f"{mode} {ctas}" for mode in MODES for ctas in args.ctas]
        lines = [f"# Pushes into a peer's buffer: {boot.world_size} x {dev}", "",
                 f"Command: `{cmd}`; torch {torch.__version__}. GB/s per direction (bytes pushed "
                 f"per launch / us per launch; CUDA graph of {args.calls} launches, median of "
                 f"{args.repeats} queued replays, max over ranks) by mode and CTAs: st = every "
                 "thread stores 16-byte units, tma = one thread per CTA issues 32 KiB bulk copies "
                 "from shared memory, tma-copy = the same from HBM through two 16 KiB stages "
                 "(tests/push_kernel.py).", "",
                 "| MiB | " + " | ".join(heads) + " |", "|---:|" + "---:|" * len(heads)]
        for r in rows:
            lines.append(f"| {r['MiB']} | " + " | ".join(
                str(r[f"{mode}_{ctas}_GBs"]) for mode in MODES for ctas in args.ctas) + " |")
        write_table(args.out, "\n".join(lines) + "\n",
                    {"device": dev, "command": cmd, "rows": rows})
    cleanup()
    return rows


if __name__ == "__main__":
    main()
