"""The path without peer memory (groups across nodes, PCIe without P2P), side by side in one run:

    peer        distnorm over peer mappings (algo "auto"): what a single node gets
    rowsplit    distnorm's torch.distributed path: all_to_all of row slices, epilogue of the own
                slice, all_gather of the outputs (Workspace(backend="none") forces it)
    nodechain   with --ranks-per-node G (1 < G < world): the same path as a chain of nodes of G
                ranks (Workspace(ranks_per_node=G), distnorm/collectives/nodechain.py); on one
                machine NVLink stands in for the link between nodes
    allgather   the previous fallback: all-gather every rank's x, ordered sum, single-GPU kernel
    nccl+fused  NCCL all-reduce, then distnorm.add_rmsnorm (the unfused pair a user would write)

    torchrun --nproc-per-node 2 benchmarks/bench_fallback.py --out benchmarks/results/fallback_h200_x2
    torchrun --nproc-per-node 4 benchmarks/bench_fallback.py --ranks-per-node 2 --out ...

fp8_per_token with a residual; every entry a CUDA graph of 20 calls (common.time_graph_us,
prequeue), median, max over ranks. Writes <out>.md and <out>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import time_graph_us  # noqa: E402

import distnorm  # noqa: E402
from distnorm.collectives.dispatch import gathered_sum  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402

SHAPES = [(1, 4096), (128, 8192), (2048, 8192), (8192, 8192)]
PATHS = ("peer", "rowsplit", "allgather", "nccl+fused")


def _callables(x, res, w, peer, nccl, chain):
    kw = dict(quant="fp8_per_token")

    def allgather():
        acc = gathered_sum(x, None)
        h = (acc + res.float()).to(x.dtype)
        return distnorm.add_rmsnorm(h, None, w, 1e-6, **kw)

    buf = torch.empty_like(x)

    def nccl_fused():
        buf.copy_(x)  # all_reduce is in place: keep x intact for the next call
        dist.all_reduce(buf)
        return distnorm.add_rmsnorm(buf, res, w, 1e-6, **kw)

    paths = {
        "peer": lambda: distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=peer, **kw),
        "rowsplit": lambda: distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=nccl, **kw),
        "allgather": allgather,
        "nccl+fused": nccl_fused,
    }
    if chain is not None:
        paths["nodechain"] = lambda: distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6,
                                                                    workspace=chain, **kw)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="also time the node chain with nodes of this many ranks")
    args = p.parse_args()
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    G = args.ranks_per_node
    paths = PATHS + (("nodechain",) if G and 1 < G < world else ())
    chain = (distnorm.Workspace(backend="none", buffer_bytes=64 << 20, ranks_per_node=G)
             if "nodechain" in paths else None)
    with distnorm.Workspace(buffer_bytes=64 << 20) as peer, \
            distnorm.Workspace(backend="none", buffer_bytes=64 << 20) as nccl:
        for M, H in SHAPES:
            g = torch.Generator("cuda").manual_seed(rank)
            x = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
            res = torch.randn(M, H, device="cuda").to(torch.bfloat16)
            w = torch.rand(H, device="cuda").to(torch.bfloat16) + 0.5
            row = {"M": M, "H": H}
            for name, fn in _callables(x, res, w, peer, nccl, chain).items():
                try:
                    t = torch.tensor([time_graph_us(fn, prequeue=True)], device="cuda")
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    row[name] = t.item()
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    row[name] = None
                    row[name + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "command": f"torchrun --nproc-per-node {world} benchmarks/bench_fallback.py "
                           + " ".join(sys.argv[1:])}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        lines = [f"# Without peer memory: {world} x {meta['device']}", "",
                 f"Command: `{meta['command']}`; torch {meta['torch']}; {meta['date']}. "
                 "fp8_per_token with residual; us per call (CUDA graph, median, max over ranks).",
                 "", "| M x H | " + " | ".join(paths) + " | rowsplit / nccl+fused |",
                 "|---|" + "---:|" * (len(paths) + 1)]
        for r in rows:
            vals = " | ".join("fail" if r[k] is None else f"{r[k]:.1f}" for k in paths)
            ratio = (f"{r['rowsplit'] / r['nccl+fused']:.2f}"
                     if r["rowsplit"] and r["nccl+fused"] else "")
            lines.append(f"| {r['M']} x {r['H']} | {vals} | {ratio} |")
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    if chain is not None:
        chain.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
