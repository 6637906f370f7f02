"""The path without peer memory (groups across nodes, PCIe without P2P), side by side in one run:

    peer          distnorm over peer mappings (algo "auto"): what a single node gets
    nopeer        distnorm without peer memory (Workspace(backend="none")), the form it picks
                  (collectives/nopeer.py, NOTE [no-peer forms])
    gather        that path, forced to all_gather x + the slots kernel (DISTNORM_NOPEER_FORM)
    split         that path, forced to all_to_all + slots kernel + one packed all_gather
    split-h       that path, forced to all_to_all + slots kernel (h only) + all_gather of h + the
                  single-GPU op on every row
    rowsplit-torch  the row split with its float32 sum in torch (rowsplit.allreduce_by_slices:
                  the fallback before the slots kernel; still the allreduce_out / node-chain path)
    nodechain     with --ranks-per-node G (1 < G < world): the node chain of G-rank nodes
                  (Workspace(ranks_per_node=G), distnorm/collectives/nodechain.py); on one
                  machine NVLink stands in for the link between nodes
    allgather     the first fallback: all-gather every rank's x, ordered sum in torch, single-GPU
                  kernel
    nccl+fused    NCCL all-reduce (in place on its own buffer, no copy: its values grow from call
                  to call, which costs NCCL and the kernel nothing), then distnorm.add_rmsnorm
  with --parts, the pieces those paths are made of, each alone (where the time goes):
    nccl-ar       NCCL all_reduce of x (in place)      nccl-ag   all_gather_into_tensor of x
    nccl-a2a      all_to_all_single of x                fused     distnorm.add_rmsnorm on one GPU
    nccl-ag-inplace  all_gather_into_tensor with the send buffer the output's own slot (NCCL skips
                  its local copy; 2 x H200 at 2048 x 4096: 94.5 us against 100.1 out of place,
                  both above the all-reduce's 78.9: fallback_inplace_h200_x2.md)
    fold          the slots kernel on [N, M, H] parts (what the gather form runs after its all_gather)

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
from distnorm.collectives.rowsplit import gather_into_tensor  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402

SHAPES = [(M, H) for H in (4096, 8192) for M in (1, 16, 128, 512, 2048, 8192, 16384)]
PATHS = ("peer", "nopeer", "gather", "split", "split-h", "rowsplit-torch", "allgather",
         "nccl+fused")
PARTS = ("nccl-ar", "nccl-ag", "nccl-ag-inplace", "nccl-a2a", "fused", "fold")


def _callables(x, res, w, peer, nccl, chain):
    from distnorm.args import allocate_outputs
    from distnorm.collectives.nopeer import fold_epilogue
    from distnorm.collectives.rowsplit import FlatSplit, allreduce_by_slices
    from distnorm.formats import make_quant_spec

    kw = dict(quant="fp8_per_token")
    spec = make_quant_spec(kw["quant"])

    def allgather():
        acc = gathered_sum(x, None)
        h = (acc + res.float()).to(x.dtype)
        return distnorm.add_rmsnorm(h, None, w, 1e-6, **kw)

    buf = x.clone()

    def nccl_fused():
        dist.all_reduce(buf)
        return distnorm.add_rmsnorm(buf, res, w, 1e-6, **kw)

    def nopeer(form):
        def call():
            os.environ["DISTNORM_NOPEER_FORM"] = form  # read when the call is made (captured)
            try:
                return distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=nccl, **kw)
            finally:
                os.environ.pop("DISTNORM_NOPEER_FORM")
        return call

    res_out, _, q_out, scales_out = allocate_outputs(x, spec, True, False, None, None, None, None)
    split = FlatSplit(None)
    chunk = max(1, nccl.buffer_bytes // (x.shape[1] * x.element_size()))

    paths = {
        "peer": lambda: distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=peer, **kw),
        "nopeer": nopeer("auto"),
        "gather": nopeer("gather"),
        "split": nopeer("split"),
        "split-h": nopeer("split-h"),
        "rowsplit-torch": lambda: allreduce_by_slices(
            x, res, w, 1e-6, spec, None, None, False, res_out, None, q_out, scales_out, None,
            split, chunk),
        "allgather": allgather,
        "nccl+fused": nccl_fused,
    }
    world = dist.get_world_size()
    gathered = torch.randn(world * x.shape[0], x.shape[1], device=x.device).to(x.dtype)
    exchanged = torch.empty_like(x)
    parts = gathered.view(world, *x.shape)
    paths.update({
        "nccl-ar": lambda: dist.all_reduce(buf),
        "nccl-ag": lambda: gather_into_tensor(gathered, x),
        "nccl-ag-inplace": lambda: gather_into_tensor(gathered, parts[dist.get_rank()]),
        "nccl-a2a": lambda: dist.all_to_all_single(exchanged, x),
        "fused": lambda: distnorm.add_rmsnorm(x, res, w, 1e-6, **kw),
        "fold": lambda: fold_epilogue(parts, res, w, 1e-6, spec, None, None, False, res_out, None,
                                      q_out, scales_out),
    })
    if chain is not None:
        paths["nodechain"] = lambda: distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6,
                                                                    workspace=chain, **kw)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="also time the node chain with nodes of this many ranks")
    p.add_argument("--buffer-mib", type=int, default=64,
                   help="workspace data buffer (MiB): the no-peer forms run in chunks that fit it")
    p.add_argument("--parts", action="store_true",
                   help="also time the pieces (NCCL all_reduce / all_gather / all_to_all, the "
                        "single-GPU op, the slots kernel) each alone")
    p.add_argument("--paths", nargs="*", default=None, help="only these paths (default: all)")
    args = p.parse_args()
    buffer_bytes = args.buffer_mib << 20
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    G = args.ranks_per_node
    paths = PATHS + (("nodechain",) if G and 1 < G < world else ()) + (PARTS if args.parts else ())
    if args.paths:
        paths = tuple(k for k in paths if k in args.paths)
    chain = (distnorm.Workspace(backend="none", buffer_bytes=buffer_bytes, ranks_per_node=G)
             if "nodechain" in paths else None)
    with distnorm.Workspace(buffer_bytes=buffer_bytes) as peer, \
            distnorm.Workspace(backend="none", buffer_bytes=buffer_bytes) as nccl:
        for M, H in SHAPES:
            g = torch.Generator("cuda").manual_seed(rank)
            x = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
            res = torch.randn(M, H, device="cuda").to(torch.bfloat16)
            w = torch.rand(H, device="cuda", generator=torch.Generator("cuda").manual_seed(H)
                           ).to(torch.bfloat16) + 0.5  # the same on every rank
            row = {"M": M, "H": H}
            for name, fn in _callables(x, res, w, peer, nccl, chain).items():
                if name not in paths:
                    continue
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
                 "", "| M x H | " + " | ".join(paths) + " | nopeer / nccl+fused |",
                 "|---|" + "---:|" * (len(paths) + 1)]
        for r in rows:
            vals = " | ".join("fail" if r[k] is None else f"{r[k]:.1f}" for k in paths)
            ratio = (f"{r['nopeer'] / r['nccl+fused']:.2f}"
                     if r.get("nopeer") and r.get("nccl+fused") else "")
            lines.append(f"| {r['M']} x {r['H']} | {vals} | {ratio} |")
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    if chain is not None:
        chain.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
