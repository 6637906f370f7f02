"""Fused all-reduce + residual add + RMSNorm (+ FP8 / NVFP4) latency, side by side in one run with
NCCL, PyTorch symmetric memory, the unfused chain (eager and torch.compile) and FlashInfer.

    torchrun --nproc-per-node N benchmarks/bench_allreduce_fusion.py --out benchmarks/results/ar_h200_xN

Each entry: CUDA graph of 20 calls, median of 19 replays queued back to back behind a sleep kernel
(us per call; common.time_graph_us(prequeue=True)), max over ranks. Inputs differ
per rank. Writes <out>.md / .json / .png. Peers that fail to run are reported, not fatal.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peers import FlashInferFusion, SymmMemAllReduce, import_flashinfer  # noqa: E402

FI = import_flashinfer()  # before anything imports cutlass

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import plot_us_per_m, time_graph_us, unfused_tail  # noqa: E402

import distnorm  # noqa: E402
from distnorm.collectives import allreduce, allreduce_add_rmsnorm  # noqa: E402
from distnorm.collectives.dispatch import gathered_sum  # noqa: E402
from distnorm.collectives.layout import buffer_for_lamport  # noqa: E402
from distnorm.collectives.plan import ALGOS, Tuning  # noqa: E402
from distnorm.collectives.state import state_of  # noqa: E402
from distnorm.comm import Workspace  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402

EPS = 1e-6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/allreduce_fusion")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 32, 128, 512, 2048, 8192, 16384])
    ap.add_argument("--hidden", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--cases", default="", help="regex: run only the cases whose name matches")
    ap.add_argument("--buffer-mib", type=int, default=0,
                    help="workspace data buffer (MiB; default: lamport's areas hold the largest M x H "
                         "call, up to 1 GiB)")
    ap.add_argument("--tuning", nargs="*", default=[],
                    help="extra distnorm variants NAME:pdl=0|1,rpc=N,rpcts=N (rows per CTA of lamport and "
                         "one-shot / of two-shot),form=push|pull-gather|pull (two-shot),"
                         "lform=poll-all|poll-unseen (lamport),ctas=N (most CTAs per launch, every algorithm), "
                         "each run as dn_*@NAME beside the defaults")
    args = ap.parse_args()
    variants = {"": {}}
    for spec in args.tuning:
        name, _, kv = spec.partition(":")
        variants["@" + name] = dict(item.split("=") for item in kv.split(",") if item)
    case_re = re.compile(args.cases) if args.cases else None
    env = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    max_m, max_h = max(args.tokens), max(args.hidden)
    # lamport's three areas share a quarter of the buffer (collectives/layout.lamport_split): a
    # buffer of world x one call's bytes chunked lamport from 1 MiB of x (128 x 4096 at 2 ranks
    # took two launches and 10.6 us instead of 6.8 in a 20 MiB buffer, eleventh session)
    ws = Workspace(group, buffer_bytes=(args.buffer_mib << 20)
                   or min(1 << 30, buffer_for_lamport(max_m * max_h * 2, world)) + (16 << 20))
    symm = None
    try:
        symm = SymmMemAllReduce(max_m * max_h, torch.bfloat16, dev, group)
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            print("symm_mem not available:", repr(e)[:200])
    fis = {}
    if FI is not None:
        for H in args.hidden:
            try:
                fis[H] = FlashInferFusion(FI, rank, world, max_m, H, group)
            except Exception as e:  # noqa: BLE001
                if rank == 0:
                    print("flashinfer workspace failed:", repr(e)[:200])
    compiled_tail = torch.compile(unfused_tail, dynamic=True) if not args.no_compile else None
    scale = torch.tensor([0.05], device=dev)
    inv = 1.0 / scale
    gs = torch.tensor([200.0], device=dev)
    rows = []
    for H in args.hidden:
        w = (torch.rand(H, device=dev) + 0.5).to(torch.bfloat16)
        for M in args.tokens:
            g = torch.Generator(device=dev).manual_seed(1000 * rank + M)
            x = torch.randn(M, H, device=dev, generator=g).to(torch.bfloat16)
            res = torch.randn(M, H, device=dev, generator=torch.Generator(device=dev).manual_seed(M)).to(torch.bfloat16)
            ro, yo, xc = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
            q8 = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=dev)
            cases = {}
            for vname, tune in variants.items():
                t = lambda tune=tune: apply_tuning(ws, tune)  # noqa: E731 - set before each call (capture)
                for algo in (("lamport", "oneshot", "twoshot") if M <= 2048 else ("oneshot", "twoshot")):
                    cases[f"dn_norm_{algo}{vname}"] = lambda a=algo, t=t: (t(), allreduce_add_rmsnorm(x, res, w, EPS, workspace=ws, norm_out=True, algo=a, residual_out=ro, y_out=yo))
                    cases[f"dn_fp8_{algo}{vname}"] = lambda a=algo, t=t: (t(), allreduce_add_rmsnorm(x, res, w, EPS, workspace=ws, quant="fp8", scale=scale, algo=a, residual_out=ro, q_out=q8))
                    cases[f"dn_nvfp4_{algo}{vname}"] = lambda a=algo, t=t: (t(), allreduce_add_rmsnorm(x, res, w, EPS, workspace=ws, quant="nvfp4", global_scale=gs, algo=a, residual_out=ro))
                    cases[f"dn_ar_{algo}{vname}"] = lambda a=algo, t=t: (t(), allreduce(x, workspace=ws, algo=a, out=xc))
            cases["nccl_ar"] = lambda: (xc.copy_(x), dist.all_reduce(xc))
            cases["unfused"] = lambda: (xc.copy_(x), dist.all_reduce(xc), unfused_tail(xc, res, w, inv))
            if compiled_tail is not None:
                cases["unf_comp"] = lambda: (xc.copy_(x), dist.all_reduce(xc), compiled_tail(xc, res, w, inv))
            if symm is not None:
                cases["symm1"] = lambda: symm.one_shot(x)
                cases["symm2"] = lambda: symm.two_shot(x)
            if H in fis:
                fi = fis[H]
                for pdl in (False, True):
                    sfx = "_pdl" if pdl else ""
                    cases["fi_norm" + sfx] = lambda p=pdl: fi.call(x, res, w, residual_out=ro, norm_out=yo, pdl=p)
                    cases["fi_fp8" + sfx] = lambda p=pdl: fi.call(x, res, w, residual_out=ro, quant_out=q8, scale=scale, pdl=p)
            if case_re is not None:
                cases = {k: v for k, v in cases.items() if case_re.search(k)}
            row = {"M": M, "H": H, "MB": M * H * 2 / 1e6}
            for name, fn in cases.items():
                dist.barrier()
                try:
                    us, lo, hi = time_graph_us(fn, stats=True, prequeue=True)
                    ok = 1.0
                    if name.startswith("dn_") and not outputs_correct(name, x, res, ro, xc):
                        print(f"rank {rank}: {name} M={M} H={H}: WRONG OUTPUT after timing", flush=True)
                        ok = 0.0
                    if hi > 3 * lo:
                        print(f"rank {rank}: {name} M={M} H={H}: replays {lo:.1f}..{hi:.1f} us (median {us:.1f})", flush=True)
                except Exception as e:  # noqa: BLE001
                    if rank == 0:
                        print(f"{name} M={M} H={H} failed: {repr(e)[:160]}", flush=True)
                    us, ok = float("nan"), 0.0
                t = torch.tensor([us if us == us else 0.0, ok], device=dev, dtype=torch.float64)
                dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
                dist.all_reduce(t[1:], op=dist.ReduceOp.MIN)
                row[name] = round(t[0].item(), 2) if t[1].item() == 1.0 else None
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            del x, res, ro, yo, xc, q8
    if rank == 0:
        meta = dict(device=torch.cuda.get_device_name(), world=world, command="torchrun --nproc-per-node %d %s" % (world, " ".join(sys.argv)),
                    torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())), date=time.strftime("%Y-%m-%d"),
                    workspace_backend=ws.backend, flashinfer=FI is not None,
                    buffer_mib=ws.buffer_bytes >> 20)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(dict(meta=meta, rows=rows), open(args.out + ".json", "w"), indent=1)
        write_table(args.out + ".md", meta, rows)
        try:
            write_plot(args.out + ".png", meta, rows)
        except Exception as e:  # noqa: BLE001 - matplotlib missing: the table is the result
            print("no plot:", e)
    for fi in fis.values():
        fi.close()
    ws.close()
    dist.barrier()
    dist.destroy_process_group()


_DEFAULT_TUNING = Tuning.from_env()


def apply_tuning(ws, tune: dict) -> None:
    """Set the workspace's launch settings for the next call: the defaults, overridden by `tune`."""
    rpc = dict(_DEFAULT_TUNING.rows_per_cta)
    if "rpc" in tune:
        rpc["lamport"] = rpc["oneshot"] = int(tune["rpc"])
    if "rpcts" in tune:
        rpc["twoshot"] = int(tune["rpcts"])
    state_of(ws).tuning = Tuning(pdl=bool(int(tune.get("pdl", _DEFAULT_TUNING.pdl))),
                                 rows_per_cta=rpc, timeout_s=_DEFAULT_TUNING.timeout_s,
                                 twoshot_form=tune.get("form", _DEFAULT_TUNING.twoshot_form),
                                 lamport_form=tune.get("lform", _DEFAULT_TUNING.lamport_form),
                                 max_ctas={a: int(tune["ctas"]) for a in ALGOS if "ctas" in tune})


def outputs_correct(name, x, res, ro, xc) -> bool:
    """The last timed call's outputs against the ordered float32 sum of the all-gathered x."""
    acc = gathered_sum(x, None)
    if name.startswith("dn_ar"):
        return torch.equal(xc.view(torch.int16), acc.to(x.dtype).view(torch.int16))
    return torch.equal(ro.view(torch.int16), (acc + res.float()).to(x.dtype).view(torch.int16))


def best(row, prefix):
    vals = [v for k, v in row.items() if k.startswith(prefix) and "@" not in k and isinstance(v, float)]
    return min(vals) if vals else None


def write_table(path, meta, rows):
    cols = [c for c in rows[0] if c not in ("M", "H", "MB")]
    lines = [f"# Fused all-reduce + add + RMSNorm (+quant), {meta['world']} x {meta['device']}", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}, NCCL {meta['nccl']}, workspace backend "
             f"{meta['workspace_backend']} ({meta.get('buffer_mib', '?')} MiB buffer), {meta['date']}. us per call: CUDA graph of 20 calls, median of 19 "
             "replays queued back to back, max over ranks. dn_* = distnorm (norm: bf16 norm output; fp8: static FP8; nvfp4: "
             "swizzled scales; ar: plain all-reduce); fi_* = FlashInfer trtllm_allreduce_fusion (fp32 acc).", "",
             "| M | H | MB | " + " | ".join(cols) + " |", "|---:|---:|---:|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['M']} | {r['H']} | {r['MB']:.2f} | " + " | ".join(
            "" if r.get(c) is None else f"{r[c]:.1f}" for c in cols) + " |")
    lines += ["", "Best of distnorm vs peers (us):", "",
              "| M | H | dn fp8 best | fi fp8 best | dn norm best | fi norm best | dn ar best | nccl | symm best |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"| {r['M']} | {r['H']} | {f(best(r, 'dn_fp8'))} | {f(best(r, 'fi_fp8'))} | {f(best(r, 'dn_norm'))} | "
                     f"{f(best(r, 'fi_norm'))} | {f(best(r, 'dn_ar'))} | {f(r.get('nccl_ar'))} | {f(best(r, 'symm'))} |")
    open(path, "w").write("\n".join(lines) + "\n")


def write_plot(path, meta, rows):
    keys = [("dn_fp8", "distnorm AR+norm+fp8 (best algo)"), ("fi_fp8", "FlashInfer AR+norm+fp8 (best)"),
            ("dn_norm", "distnorm AR+norm"), ("fi_norm", "FlashInfer AR+norm"), ("dn_ar", "distnorm all-reduce"),
            ("nccl_ar", "NCCL all-reduce"), ("symm", "symm-mem all-reduce (best)"), ("unf_comp", "NCCL + compiled add/norm/fp8")]
    plot_us_per_m(path, meta, rows, [
        (label, "-" if key.startswith("dn") else "--",
         (lambda r, k=key: r.get(k)) if key in ("nccl_ar", "unf_comp") else (lambda r, k=key: best(r, k)))
        for key, label in keys])


if __name__ == "__main__":
    main()
