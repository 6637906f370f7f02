"""The fused add + RMSNorm + quant behind a GEMM, as it runs in a model: what the norm adds to a
CUDA graph of GEMM -> norm pairs, with programmatic dependent launch on and off, side by side with
torch.compile of the same GEMM + reference chain (static shapes, in the same kind of graph).

    python benchmarks/bench_after_gemm.py --out benchmarks/results/after_gemm_h200

Each pair is h = a @ w (cuBLAS, bf16 [M, K] x [K, H]) then distnorm.add_rmsnorm(h, residual, ...).
Columns (us per pair, median over rounds in which every column's graph replays once; every graph
cycles through enough input sets, GEMM weights included, that no call finds its data in L2):
  gemm        the GEMM alone
  dn_pdl      GEMM + distnorm with PDL on (the default): the norm's launch may overlap the
              GEMM's tail
  dn_nopdl    the same with DISTNORM_PDL=0 (kernels compiled without PDL)
  compiled    torch.compile(dynamic=False) of a @ w + add_rmsnorm_ref: Inductor's call of the
              same cuBLAS GEMM and its fused add / norm / quant kernel(s)
  norm        distnorm alone, back to back (PDL on: each call's launch overlaps the previous
              call, which triggers its dependents at its start), the same rows
  norm_nopdl  the same with PDL off
  dn_nocta, norm_nocta (--one-cta-off)  PDL on, DISTNORM_ONE_CTA_PER_SM=0 (NOTE [one CTA per SM]
              in distnorm/kernels/fused_norm.py off)
and the norm's marginal time (median over the rounds of pair - gemm) for the three pairs. How early
the norm may start is the GEMM kernel's choice (cuBLAS picks one per shape), so dn_pdl against
dn_nopdl is what PDL gives or costs behind that GEMM (results/after_gemm_h200.md: per shape).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_single_gpu import VARIANTS, count_bytes, variant_kwargs  # noqa: E402
from common import capture_graph, write_table  # noqa: E402

import distnorm  # noqa: E402
from distnorm import formats, ops  # noqa: E402
from distnorm.reference import add_rmsnorm_ref  # noqa: E402

MAX_SETS = 16


def _sets(M: int, K: int, H: int, w_norm, kw: dict, count: int) -> list:
    """`count` input sets (a [M, K], w [K, H], h [M, H], residual [M, H], outputs): random, never
    zeros; the outputs allocated once so the timed calls pass them."""
    out = []
    for _ in range(count):
        a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        w = (torch.randn(K, H, device="cuda") / K ** 0.5).to(torch.bfloat16)
        h = a @ w
        r = torch.randn(M, H, device="cuda").to(torch.bfloat16)
        o = distnorm.add_rmsnorm(h, r, w_norm, 1e-6, **kw)
        outs = dict(residual_out=o.residual, y_out=o.y, q_out=o.q,
                    scales_out=o.scales if kw.get("quant") != "fp8" else None)
        out.append((a, w, h, r, outs))
    return out


def _graph(call, sets) -> tuple:
    """(graph, calls): call(set) captured at least 20 times, cycling through the sets."""
    n = max(20, len(sets))
    counter = iter(range(1 << 30))
    return capture_graph(lambda: call(sets[next(counter) % len(sets)]), n), n


def _alternating_us(graphs: dict, rounds: int = 15) -> dict:
    """Median us per call of each graph, the graphs replayed in turn in every round: at large M
    the GEMM's clock drifts by 10-15 % between runs (seen: 339 against 389 us for one shape), so
    a pair and its GEMM are compared within a round, and the marginal is the median of the
    rounds' differences."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, (g, n) in graphs.items():
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000.0 / n)
    out = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        if name.startswith(("dn_", "compiled")):
            out[name + "_marginal"] = statistics.median(a - b for a, b in zip(t, times["gemm"]))
    return out


def _set_env(name: str, on: bool) -> None:
    """DISTNORM_PDL / DISTNORM_ONE_CTA_PER_SM are read when a kernel key is first compiled: set
    one and forget the cached call kernels, so the next call compiles (or finds) that kernel."""
    os.environ[name] = "1" if on else "0"
    ops.clear_kernel_caches()


def _check(sets, w_norm, kw) -> None:
    """The pair's outputs against the reference on the first set: a benchmark of wrong output
    is no benchmark (the kernels' own tests check every element; this catches a broken setup)."""
    a, w, h, r, outs = sets[0]
    torch.mm(a, w, out=h)
    got = distnorm.add_rmsnorm(h, r.clone(), w_norm, 1e-6, **kw)
    ref = add_rmsnorm_ref(h, r, w_norm, 1e-6, **kw)
    if not torch.equal(got.residual, ref.residual):
        raise SystemExit("bench_after_gemm: the fused residual differs from the reference")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/after_gemm")
    ap.add_argument("--Ms", type=int, nargs="+", default=[1, 8, 24, 128, 512, 2048, 8192])
    ap.add_argument("--Hs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--Ks", type=int, nargs="+", default=[0],
                    help="the GEMM's inner sizes (0: H)")
    ap.add_argument("--variants", nargs="+", default=["fp8", "nvfp4"])
    ap.add_argument("--compile-Ms", type=int, nargs="*", default=[1, 24, 2048],
                    help="row counts that also get the torch.compile column (a compile each)")
    ap.add_argument("--one-cta-off", action="store_true",
                    help="also columns dn_nocta / norm_nocta: DISTNORM_ONE_CTA_PER_SM=0")
    ap.add_argument("--note")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    torch._dynamo.config.cache_size_limit = 1024
    rows = []
    for vname in args.variants:
        kw = variant_kwargs(vname)
        quant, opts = VARIANTS[vname]
        spec = formats.make_quant_spec(quant, **opts)
        for H, K in [(H, K or H) for H in args.Hs for K in args.Ks]:
            w_norm = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
            for M in args.Ms:
                footprint = 2 * (M * K + K * H) + count_bytes(spec, M, H)
                sets = _sets(M, K, H, w_norm, kw, min(MAX_SETS, max(2, -(-2 * l2 // footprint))))
                _check(sets, w_norm, kw)

                def gemm(s):
                    torch.mm(s[0], s[1], out=s[2])

                def norm(s, kw=kw, w_norm=w_norm):
                    distnorm.add_rmsnorm(s[2], s[3], w_norm, 1e-6, **kw, **s[4])

                def pair(s):
                    gemm(s)
                    norm(s)
                row = dict(variant=vname, M=M, H=H, K=K, sets=len(sets))
                graphs = {"gemm": _graph(gemm, sets)}
                for on in (True, False):
                    _set_env("DISTNORM_PDL", on)
                    graphs["dn_pdl" if on else "dn_nopdl"] = _graph(pair, sets)
                    graphs["norm" if on else "norm_nopdl"] = _graph(norm, sets)
                _set_env("DISTNORM_PDL", True)
                if args.one_cta_off:
                    _set_env("DISTNORM_ONE_CTA_PER_SM", False)
                    graphs["dn_nocta"] = _graph(pair, sets)
                    graphs["norm_nocta"] = _graph(norm, sets)
                    _set_env("DISTNORM_ONE_CTA_PER_SM", True)
                if M in args.compile_Ms:
                    chain = torch.compile(lambda a, w, r, kw=kw, w_norm=w_norm: add_rmsnorm_ref(
                        a @ w, r, w_norm, 1e-6, **kw), dynamic=False)
                    graphs["compiled"] = _graph(lambda s: chain(s[0], s[1], s[3]), sets)
                row.update(_alternating_us(graphs))
                del graphs
                rows.append(row)
                print(json.dumps(row), flush=True)
                del sets
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), command=" ".join(sys.argv), note=args.note,
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    columns = ("gemm", "norm", "norm_nopdl", "dn_pdl", "dn_nopdl", "compiled", "dn_pdl_marginal",
               "dn_nopdl_marginal", "compiled_marginal") + (
               ("norm_nocta", "dn_nocta_marginal") if args.one_cta_off else ())
    head = ("| variant | M | H | K | gemm | norm alone | norm alone no PDL | +dn PDL | +dn no PDL "
            "| +compiled | marginal PDL | marginal no PDL | marginal compiled |"
            + (" norm alone, one CTA per SM off | marginal, off |" if args.one_cta_off else "")
            + "\n"
            + "|---" * len(columns) + "|---" * 4 + "|\n")

    def cell(row, k):
        return f"{row[k]:.2f}" if k in row else "-"
    body = "".join(
        f"| {r['variant']} | {r['M']} | {r['H']} | {r['K']} | " + " | ".join(
            cell(r, k) for k in columns) + " |\n"
        for r in rows)
    text = (f"{meta['device']}, torch {meta['torch']}, {meta['date']}: `{meta['command']}`\n"
            f"{meta['note'] or ''}\nus per GEMM -> norm pair (CUDA graph, rotating sets)\n\n"
            + head + body)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_table(args.out, text, dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
