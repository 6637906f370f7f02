"""Time per tensor-parallel decoder layer (examples/tp_llama.py) in six forms, side by side in one run:

    (a) floor      the layer without its all-reduces (compute only), torch.compile
    (b) eager      NCCL dist.all_reduce + torch ops, eager
    (c) compile    (b) under torch.compile(fullgraph=True, dynamic=False), no fusion pass
    (d) pass       (c) with distnorm.fusion's pass
    (e) distnorm   eager layer with distnorm.tp.AllReduceAddRMSNorm
    (f) seqpar     eager sequence-parallel layer: distnorm.tp.ReduceScatterAddRMSNorm, the residual
                   sharded by rows, every row's output gathered for the next GEMM

    torchrun --nproc-per-node 2 benchmarks/bench_tp_layer.py --model 8b --out benchmarks/results/tp_layer_h200_x2 [--fp8]

Decode: M sequences of one token over a 512-token KV cache; prefill: one prompt of M tokens. Every
form runs in a CUDA graph (common.time_graph_us: 20 calls per graph, median of queued replays),
max over ranks, divided by the layers of the stack. Writes <out>.md / .json / .png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), _ROOT, os.path.join(_ROOT, "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import time_graph_us  # noqa: E402

import distnorm  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402
from tp_llama import (MODELS, Config, DecoderStack, compile_with_pass, make_inputs,  # noqa: E402
                      residual_rows)

FORMS = ("floor", "eager", "compile", "pass", "distnorm", "seqpar")


def _callables(cfg, layers, ws, device):
    """form -> (model, how to call it): compiled forms compile on their first call."""
    torch._dynamo.config.cache_size_limit = 64
    floor = torch.compile(DecoderStack(cfg, layers, "floor", ws, device), fullgraph=True,
                          dynamic=False)
    plain = DecoderStack(cfg, layers, "torch", ws, device)
    compiled = torch.compile(plain, fullgraph=True, dynamic=False)
    with_pass, fusion = compile_with_pass(DecoderStack(cfg, layers, "torch", ws, device), ws)
    fused = DecoderStack(cfg, layers, "distnorm", ws, device)
    seqpar = DecoderStack(cfg, layers, "seqpar", ws, device)
    return {"floor": floor, "eager": plain, "compile": compiled, "pass": with_pass,
            "distnorm": fused, "seqpar": seqpar}, fusion


def _time(fn, a, residual, caches) -> float:
    res = residual.clone()
    with torch.no_grad():
        us = time_graph_us(lambda: fn(a, res, caches), prequeue=True)
    t = torch.tensor([us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--decode", type=int, nargs="*", default=[1, 8, 32, 128])
    p.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = replace(Config(**MODELS[args.model]), fp8=args.fp8)
    rows = []
    with distnorm.Workspace(dist.group.WORLD) as ws:
        forms, fusion = _callables(cfg, args.layers, ws, device)
        for phase, sizes in (("decode", args.decode), ("prefill", args.prefill)):
            for M in sizes:
                a, residual, caches = make_inputs(cfg, M, phase == "decode", args.layers, device)
                row = {"phase": phase, "M": M}
                for name in FORMS:
                    before = len(fusion.fused)
                    try:
                        res = residual_rows(residual, ws) if name == "seqpar" else residual
                        row[name] = _time(forms[name], a, res, caches) / args.layers
                        if name == "pass":  # what this shape's compile fused (one compile each)
                            row["pass_sites"] = len(fusion.fused) - before
                    except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
                        row[name] = None
                        row[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                if dist.get_rank() == 0:
                    print(row, flush=True)
    if dist.get_rank() == 0:
        meta = {"device": torch.cuda.get_device_name(), "world": dist.get_world_size(),
                "model": args.model, "fp8": args.fp8, "layers": args.layers,
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "fused_sites_per_compile": sorted({r.get("pass_sites") for r in rows} - {None}),
                "command": "torchrun --nproc-per-node {} benchmarks/bench_tp_layer.py {}".format(
                    dist.get_world_size(), " ".join(sys.argv[1:]))}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        write_table(args.out + ".md", meta, rows)
        try:
            write_plot(args.out + ".png", meta, rows)
        except Exception as e:  # noqa: BLE001 - matplotlib missing: the table is the result
            print(f"no plot: {e}")
    dist.destroy_process_group()


def _fmt(v) -> str:
    return "fail" if v is None else f"{v:.1f}"


def write_table(path, meta, rows) -> None:
    lines = [f"# TP decoder layer, {meta['model']}{' FP8' if meta['fp8'] else ''}, "
             f"{meta['world']} x {meta['device']}", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}; {meta['date']}. us per layer "
             f"(CUDA graph, median, max over ranks). Sites the pass fused per compiled stack of "
             f"{meta['layers']} layers (one compile per shape): {meta['fused_sites_per_compile']}.",
             "",
             "| phase | M | (a) floor | (b) eager NCCL | (c) compile | (d) compile + pass | "
             "(e) distnorm.tp | (f) seqpar | (d)/(a) | (c)/(d) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = (lambda x, y: f"{x / y:.2f}" if x and y else "")
        lines.append(f"| {r['phase']} | {r['M']} | " + " | ".join(_fmt(r[f]) for f in FORMS)
                     + f" | {ratio(r['pass'], r['floor'])} | {ratio(r['compile'], r['pass'])} |")
    errors = [f"- {r['phase']} M={r['M']} {f}: {r[f + '_error']}" for r in rows for f in FORMS
              if f + "_error" in r]
    with open(path, "w") as f:
        f.write("\n".join(lines + ([""] + errors if errors else [])) + "\n")


def write_plot(path, meta, rows) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("decode", "prefill")):
        rs = [r for r in rows if r["phase"] == phase]
        for f in FORMS:
            ax.plot([r["M"] for r in rs], [r[f] for r in rs], marker="o", label=f)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{phase}: us per layer")
        ax.set_xlabel("tokens (M)")
        ax.legend()
    fig.suptitle(f"{meta['model']} TP{meta['world']} {meta['device']}: {meta['command']}",
                 fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
