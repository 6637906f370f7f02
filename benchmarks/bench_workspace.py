"""Workspace creation / close time per backend, and the leak check numbers (device memory, fds).

    torchrun --nproc-per-node N benchmarks/bench_workspace.py --out benchmarks/results/workspace_h200_xN
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distnorm.comm import Workspace  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/workspace")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for backend in ("vmm", "torch_symm", "nvshmem"):
        times, closes = [], []
        try:
            for _ in range(args.repeats):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ws = Workspace(buffer_bytes=64 << 20, backend=backend)
                t1 = time.perf_counter()
                ws.close()
                torch.cuda.synchronize()
                times.append((t1 - t0) * 1e3)
                closes.append((time.perf_counter() - t1) * 1e3)
                if backend == "torch_symm":
                    break  # PyTorch keeps symmetric allocations for the process: one creation only
            t = torch.tensor([statistics.median(times), statistics.median(closes)], device="cuda", dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            result[backend] = {"create_ms": round(t[0].item(), 2), "close_ms": round(t[1].item(), 2), "n": len(times)}
        except Exception as e:  # noqa: BLE001
            result[backend] = {"error": repr(e)[:200]}
        dist.barrier()
    if rank == 0:
        meta = dict(device=torch.cuda.get_device_name(), world=world, date=time.strftime("%Y-%m-%d"),
                    command=f"torchrun --nproc-per-node {world} " + " ".join(sys.argv))
        print(json.dumps(dict(meta=meta, result=result)))
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(dict(meta=meta, result=result), open(args.out + ".json", "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
