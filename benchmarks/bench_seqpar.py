"""Sequence-parallel reduce-scatter + residual add + RMSNorm + quantization, with the quantized rows
gathered for the next GEMM, side by side in one run with the unfused chain and all-reduce alone:

    dn_rs_<fmt>_gather  distnorm.reduce_scatter_add_rmsnorm(..., gather=True): q / scales of all M
                        rows on every rank, the residual shard updated (gathered through the peers:
                        kernels/rowgather.py), in the forms the defaults pick by size (NOTE
                        [sized forms] in collectives/plan.py); _serial: the first forms forced
    dn_rs_<fmt>_gather_nccl  the same, gathered by NCCL all_gather (Tuning.gather_by = "nccl")
    dn_rs_nvfp4_gather_lin  the same, the block scales pushed as linear rows and laid out
                        (swizzled) after the kernel (gather_by "epilogue", the default before
                        the kernel laid them out itself: NOTE [swizzled scales gathered] in
                        kernels/reducescatter.py); _g2_lin: in the "pipelined-g2" form
    dn_rs_<fmt>_gather_pipe  the same, the reduce-scatter in its "pipelined" form
                        (Tuning.reducescatter_form; NOTE [reduce-scatter rounds]); _pipe8 / _pipe16
                        / _pipe32 / _pipe2: its "pipelined-8" / -16 / -32 / -2 forms (up to 8 /
                        16 / 32 / 2 rounds per CTA); _g2 / _g4: "pipelined-g2" / -g4 (rounds of
                        at most 2 / 4 row groups); _tma: "pipelined-tma" (the x pushes as TMA
                        bulk copies, NOTE [bulk-copy pushes]); _roles: "roles-tma" (pusher CTAs
                        that push by TMA bulk copies, finisher CTAs that finish row groups as
                        they land, NOTE [reduce-scatter roles by TMA]); _batched: the row gather
                        in its "batched" form (Tuning.rowgather_form; NOTE [row gather
                        batches]); _both: both;
                        _r1: one row per CTA in the reduce-scatter (Tuning.rows_per_cta;
                        choose_tiling's gives two at H <= 4096);
                        _pipe_r1 / _pipe2_r1 / _tma_r1: pipelined / pipelined-2 /
                        pipelined-tma with one row per CTA; _c<N>
                        (with `--rs-ctas N ...`): the reduce-scatter's grid capped at N CTAs
                        (Tuning.max_ctas)
    dn_rs_<fmt>         the same without the gather (the shard's outputs only); dn_rs_<fmt>_pipe in
                        the "pipelined" form
    unfused_fp8         NCCL reduce_scatter + add + RMSNorm + static FP8 in torch + NCCL all_gather
                        of the FP8 bytes (what a sequence-parallel layer writes without distnorm)
    unfused_fp8_comp    the same, its torch part compiled (static shapes, one compile per shape)
    dn_ar_fp8           distnorm's fused all-reduce + add + RMSNorm + FP8 (all M rows on every rank)
    dn_ar, nccl_ar, symm2   all-reduce alone: distnorm (algo auto), NCCL, symm-mem two-shot
    nccl_rs             NCCL reduce_scatter alone (bf16): the reduce-scatter's link-bound reference

    torchrun --nproc-per-node N benchmarks/bench_seqpar.py --out benchmarks/results/seqpar_h200_xN

fmt: fp8 (static) and nvfp4 (swizzled scales); `--formats` also takes fp8pt (per-token FP8). M
must be a multiple of N (NCCL's reduce_scatter takes equal shards). Every entry: a CUDA graph of 20 calls (common.time_graph_us, prequeue), median,
max over ranks. `GB/s`: the bytes one GPU must send in the fused form -- (N-1)/N of the M x H bf16
partial sums, plus (N-1)/N of the gathered q and scales -- over dn_rs_<fmt>_gather's time. Before
timing, each shape's distnorm outputs are checked bitwise against the fused all-reduce's (residual
rows of the shard, gathered q and scales); `rs_kernel` says whether the reduce-scatter ran as one
peer kernel launch (False: in chunks, or torch.distributed; NOTE [reduce-scatter chunks]). Writes <out>.md /
.json / .png. `--smoke`: the check and every case once, no timing (CPU: gloo ranks and a CPU
workspace; tests/test_bench_smoke.py). `--cases REGEX`: time only the matching cases (A/Bs of one
form: benchmarks/ab_trees.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import plot_us_per_m, time_graph_us, unfused_tail  # noqa: E402

import distnorm  # noqa: E402
from distnorm.collectives import seqpar  # noqa: E402
from distnorm.collectives.rowsplit import gather_into_tensor  # noqa: E402
from distnorm.collectives.state import state_of  # noqa: E402
from distnorm.launch import init_distributed  # noqa: E402

EPS = 1e-6
FORMATS = ("fp8", "nvfp4")  # timed by default; --formats also takes fp8pt (per-token FP8)
# the reduce-scatter's forms (plan.REDUCESCATTER_FORMS) -> their column tag, dn_rs_<fmt>_gather_<tag>
RS_FORM_TAGS = {"serial": "serial", "pipelined": "pipe", "pipelined-8": "pipe8",
                "pipelined-16": "pipe16", "pipelined-32": "pipe32", "pipelined-2": "pipe2",
                "pipelined-g2": "g2", "pipelined-g4": "g4", "pipelined-tma": "tma",
                "roles-tma": "roles"}


def format_kwargs(fmt: str, device) -> dict:
    """The op keywords of a format: static FP8 scale 0.05, per-token FP8, NVFP4 global scale 200."""
    if fmt == "fp8":
        return dict(quant="fp8", scale=torch.tensor([0.05], device=device))
    if fmt == "fp8pt":
        return dict(quant="fp8_per_token")
    return dict(quant="nvfp4", global_scale=torch.tensor([200.0], device=device))


def sent_bytes(fmt: str, M: int, H: int, world: int) -> float:
    """Bytes one GPU sends in the fused form: its share of the reduce-scatter and of the gather."""
    # FP8 codes (+ a float32 scale per row); FP4 codes + one e4m3 per 16
    q_row = {"fp8": H, "fp8pt": H + 4}.get(fmt, H // 2 + H // 16)
    return (world - 1) / world * M * (2 * H + q_row)


def same_bytes(a, b) -> bool:
    return a is None and b is None or (a is not None and b is not None and a.shape == b.shape
                                       and torch.equal(a.contiguous().view(torch.uint8),
                                                       b.contiguous().view(torch.uint8)))


def outputs_match(x, res, w, ws, formats=FORMATS) -> bool:
    """Every format and reduce-scatter form: the shard's residual and the gathered q / scales
    bitwise the fused all-reduce's (the op's contract)."""
    from distnorm.collectives.plan import REDUCESCATTER_FORMS

    a, b = distnorm.shard_rows(x.shape[0], ws)
    ok = True
    for fmt in formats:
        kw = format_kwargs(fmt, x.device)
        full = distnorm.allreduce_add_rmsnorm(x, res, w, EPS, workspace=ws, **kw)
        # the pipelined forms' rows gathered in the row gather's batched form
        for rs_form in REDUCESCATTER_FORMS:
            rg_form = "unit" if rs_form == "serial" else "batched"
            got = tuned(ws, lambda: distnorm.reduce_scatter_add_rmsnorm(
                x, res[a:b], w, EPS, workspace=ws, gather=True, **kw),
                reducescatter_form=rs_form, rowgather_form=rg_form)
            ok &= same_bytes(got.residual, full.residual[a:b]) and same_bytes(got.q, full.q)
            if fmt != "fp8":
                ok &= same_bytes(got.scales, full.scales)
        if fmt == "nvfp4":  # scales pushed linear, laid out after the kernel (the default: by it)
            got = tuned(ws, lambda: distnorm.reduce_scatter_add_rmsnorm(
                x, res[a:b], w, EPS, workspace=ws, gather=True, **kw), gather_by="epilogue")
            ok &= same_bytes(got.q, full.q) and same_bytes(got.scales, full.scales)
    return bool(ok)


def tuned(ws, call, **fields):
    """call() with the workspace's Tuning fields set (restored after): gather_by, the forms."""
    import dataclasses

    state = state_of(ws)
    kept = state.tuning
    state.tuning = dataclasses.replace(kept, **fields)
    try:
        return call()
    finally:
        state.tuning = kept


def cases(x, res, w, ws, nccl: bool, symm, compiled_tail, formats=FORMATS,
          rs_ctas: tuple = ()) -> dict:
    """name -> callable of one call (module docstring)."""
    M, H = x.shape
    world = dist.get_world_size()
    a, b = distnorm.shard_rows(M, ws)
    res_shard = res[a:b].clone()
    c = {}

    def rs(kw, gather, **fields):
        """One reduce-scatter call of format kwargs kw, with Tuning `fields` set when given."""
        def call():
            return distnorm.reduce_scatter_add_rmsnorm(x, res_shard, w, EPS, workspace=ws,
                                                       gather=gather, **kw)
        return (lambda: tuned(ws, call, **fields)) if fields else call

    for fmt in formats:
        kw = format_kwargs(fmt, x.device)
        c[f"dn_rs_{fmt}_gather"] = rs(kw, True)
        c[f"dn_rs_{fmt}_gather_nccl"] = rs(kw, True, gather_by="nccl")
        if fmt == "nvfp4":  # the one format with swizzled scales here
            c[f"dn_rs_{fmt}_gather_lin"] = rs(kw, True, gather_by="epilogue")
            c[f"dn_rs_{fmt}_gather_g2_lin"] = rs(kw, True, gather_by="epilogue",
                                                 reducescatter_form="pipelined-g2")
        forced = [(tag, (rs_form, "unit")) for rs_form, tag in RS_FORM_TAGS.items()]
        for tag, (rs_form, rg_form) in forced + [("batched", ("serial", "batched")),
                                                 ("both", ("pipelined", "batched"))]:
            c[f"dn_rs_{fmt}_gather_{tag}"] = rs(kw, True, reducescatter_form=rs_form,
                                                rowgather_form=rg_form)
        one_row = {**state_of(ws).tuning.rows_per_cta, "reducescatter": 1}
        c[f"dn_rs_{fmt}_gather_r1"] = rs(kw, True, rows_per_cta=one_row)
        # twice the row groups, so twice per round (pipelined-tma: two per round where a stage
        # held one)
        for rs_form in ("pipelined", "pipelined-2", "pipelined-tma"):
            c[f"dn_rs_{fmt}_gather_{RS_FORM_TAGS[rs_form]}_r1"] = rs(
                kw, True, reducescatter_form=rs_form, rowgather_form="unit", rows_per_cta=one_row)
        for cap in rs_ctas:
            c[f"dn_rs_{fmt}_gather_c{cap}"] = rs(
                kw, True, max_ctas={**state_of(ws).tuning.max_ctas, "reducescatter": cap})
        c[f"dn_rs_{fmt}"] = rs(kw, False)
        c[f"dn_rs_{fmt}_pipe"] = rs(kw, False, reducescatter_form="pipelined")
    fp8 = format_kwargs("fp8", x.device)
    c["dn_ar_fp8"] = lambda: distnorm.allreduce_add_rmsnorm(x, res, w, EPS, workspace=ws, **fp8)
    summed = torch.empty_like(x)
    c["dn_ar"] = lambda: distnorm.allreduce(x, workspace=ws, out=summed)
    if nccl:
        shard = torch.empty(M // world, H, dtype=x.dtype, device=x.device)
        q_all = torch.empty(M, H, dtype=torch.uint8, device=x.device)
        inv = 1.0 / fp8["scale"]

        def unfused(tail):
            dist.reduce_scatter_tensor(shard, x)
            h, q = tail(shard, res_shard, w, inv)
            gather_into_tensor(q_all, q.view(torch.uint8))
            return h, q_all
        c["unfused_fp8"] = lambda: unfused(unfused_tail)
        if compiled_tail is not None:
            c["unfused_fp8_comp"] = lambda: unfused(compiled_tail)
        c["nccl_ar"] = lambda: (summed.copy_(x), dist.all_reduce(summed))
        c["nccl_rs"] = lambda: dist.reduce_scatter_tensor(shard, x)
    if symm is not None:
        c["symm2"] = lambda: symm.two_shot(x)
    return c


def main(argv=None) -> list:
    """Run the benchmark (or its smoke form); returns the rows (rank 0 also writes the results)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/seqpar")
    ap.add_argument("--tokens", type=int, nargs="*", default=[128, 512, 2048, 8192, 16384])
    ap.add_argument("--hidden", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--buffer-mib", type=int, default=0,
                    help="workspace data buffer (MiB; default: one reduce-scatter launch for the "
                         "largest call); smaller runs large calls in chunks")
    ap.add_argument("--smoke", action="store_true", help="check + every case once, no timing")
    ap.add_argument("--formats", nargs="*", default=list(FORMATS),
                    choices=["fp8", "fp8pt", "nvfp4"], help="fp8pt: per-token FP8")
    ap.add_argument("--cases", default="", help="regex: time only the cases whose name matches "
                    "(the bitwise check still runs)")
    ap.add_argument("--rs-ctas", type=int, nargs="*", default=[],
                    help="add dn_rs_<fmt>_gather_c<N>: the reduce-scatter's grid capped at N CTAs")
    args = ap.parse_args(argv)
    case_re = re.compile(args.cases) if args.cases else None
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if any(M % world for M in args.tokens):
        raise SystemExit(f"--tokens must be multiples of the world size {world}: {args.tokens}")
    on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    max_m, max_h = max(args.tokens), max(args.hidden)
    ws = distnorm.Workspace(dist.group.WORLD, device=None if on_gpu else "cpu",
                            # the reduce-scatter's pushes live in the lower half of the general
                            # part (3/4 of the buffer): one launch for the largest call
                            buffer_bytes=(args.buffer_mib << 20) or
                            min(1 << 31, max_m * max_h * 2 * 8 // 3 + (32 << 20)))
    symm = None
    if on_gpu:
        from peers import SymmMemAllReduce
        try:
            symm = SymmMemAllReduce(max_m * max_h, torch.bfloat16, dev, dist.group.WORLD)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"rank {rank}: symm_mem not available: {e!r}"[:200], flush=True)
    compiled_tail = None
    if on_gpu and not args.no_compile and not args.smoke:
        torch._dynamo.config.cache_size_limit = 1024  # one static compile per shape
        compiled_tail = torch.compile(unfused_tail, dynamic=False)
    rows = []
    for H in args.hidden:
        # the same weight on every rank (as a TP layer's replicated norm weight): the ops' outputs
        # are bitwise equal across ranks and forms only then
        w = (torch.rand(H, device=dev, generator=torch.Generator(dev).manual_seed(H))
             + 0.5).to(torch.bfloat16)
        for M in args.tokens:
            x = torch.randn(M, H, device=dev, generator=torch.Generator(dev).manual_seed(rank)
                            ).to(torch.bfloat16)
            res = torch.randn(M, H, device=dev, generator=torch.Generator(dev).manual_seed(M)
                              ).to(torch.bfloat16)
            one_launch = seqpar._kernel_chunk(ws, x, None) >= -(-M // world)
            row = {"M": M, "H": H, "rs_kernel": on_gpu and one_launch,
                   "outputs_match": outputs_match(x, res, w, ws, args.formats)}
            for name, fn in cases(x, res, w, ws, on_gpu, symm, compiled_tail,
                                  args.formats, tuple(args.rs_ctas)).items():
                if case_re is not None and not case_re.search(name):
                    continue
                dist.barrier()
                try:
                    us = 0.0 if args.smoke else time_graph_us(fn, prequeue=True)
                    if args.smoke:
                        fn()
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    print(f"rank {rank}: {name} M={M} H={H} failed: {e!r}"[:240], flush=True)
                    us = float("nan")
                t = torch.tensor([us], dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                row[name] = None if t.item() != t.item() else round(t.item(), 2)
            for fmt in args.formats:
                us = row.get(f"dn_rs_{fmt}_gather")
                row[f"GB/s {fmt}"] = round(sent_bytes(fmt, M, H, world) / us / 1e3, 1) if us else None
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0 and not args.smoke:
        write_results(args.out, world, rows)
    ws.close()
    dist.barrier()
    return rows


def write_results(out: str, world: int, rows: list) -> None:
    meta = dict(device=torch.cuda.get_device_name(), world=world, torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"),
                command=f"torchrun --nproc-per-node {world} benchmarks/bench_seqpar.py "
                        + " ".join(sys.argv[1:]))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    cols = list(dict.fromkeys(c for r in rows for c in r if c not in ("M", "H")))
    lines = [f"# Sequence-parallel RS + add + RMSNorm + quant (+ gather), {world} x {meta['device']}",
             "", f"Command: `{meta['command']}`; torch {meta['torch']}; {meta['date']}. us per call "
             "(CUDA graph of 20 calls, median, max over ranks); names in benchmarks/bench_seqpar.py.",
             "", "| M | H | " + " | ".join(cols) + " |", "|---:|---:|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['M']} | {r['H']} | " + " | ".join(
            "" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        write_plot(out + ".png", meta, rows)
    except ImportError as e:  # matplotlib missing: the table is the result
        print(f"no plot: {e}")


def _best_allreduce(r: dict):
    return min((r[k] for k in ("dn_ar", "nccl_ar", "symm2") if r.get(k)), default=None)


def write_plot(path: str, meta: dict, rows: list) -> None:
    """us per call against M, one panel per H (log-log)."""
    plot_us_per_m(path, meta, rows, [
        ("distnorm RS+norm+FP8, gathered", "-", lambda r: r.get("dn_rs_fp8_gather")),
        ("distnorm RS+norm+NVFP4, gathered", "-", lambda r: r.get("dn_rs_nvfp4_gather")),
        ("distnorm RS+norm+FP8, NCCL gather", ":", lambda r: r.get("dn_rs_fp8_gather_nccl")),
        ("NCCL RS + torch add/norm/FP8 + NCCL gather", "--", lambda r: r.get("unfused_fp8")),
        ("the same, torch part compiled", "--", lambda r: r.get("unfused_fp8_comp")),
        ("distnorm fused all-reduce+norm+FP8", ":", lambda r: r.get("dn_ar_fp8")),
        ("all-reduce alone (best of distnorm / NCCL / symm-mem)", ":", _best_allreduce)])


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
