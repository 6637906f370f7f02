"""A/B of source trees: a benchmark run from each tree's own checkout (its own code and kernel
cache), the trees alternated for several rounds, then one table of us per call in every round and
each tree's change of the mean against the first tree. `--bench single_gpu` (default:
bench_single_gpu.py on one GPU), `--bench after_gemm` (bench_after_gemm.py: a row per marginal
time), or `--bench allreduce_fusion` / `seqpar` / `fallback` under `torchrun --nproc-per-node N`
(`--nproc N`, default 2): their wide rows (a column per case) become one row per case.
Alternating rounds in one device call is what makes a 2-3% difference readable: the same point
drifts by about that much between device sessions (the unchanged kernels of an A/B are its noise
floor: show them too).

    git worktree add --detach ../base main         # the tree to compare against
    python benchmarks/ab_trees.py --tree base=../base --tree new=. --rounds 2 \\
        --out benchmarks/results/my_change_ab_h200 -- --no-compile --Hs 4096 32768 --Ms 1 1024

    # fault handling's cost (issue 11): the commit that brought it against its parent, on 2 GPUs
    git worktree add --detach ../before 06bbda4^ && git worktree add --detach ../after 06bbda4
    python benchmarks/ab_trees.py --bench allreduce_fusion --nproc 2 --tree before=../before \
        --tree after=../after --tree main=. --out benchmarks/results/faults_ab_h200_x2 \
        -- --no-compile --tokens 1 128 2048 8192 --hidden 4096 --cases '^dn_'

Everything after `--` goes to the benchmark. Writes <out>.md (the table) and <out>.json
(meta, and rows {variant, M, H, <tree>_us: [us of each round]}); each run's own files stay in
<out>_runs/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


#: --bench names: the benchmark script, and whether it runs one process per GPU under torchrun
BENCHES = {"single_gpu": ("bench_single_gpu.py", False),
           "allreduce_fusion": ("bench_allreduce_fusion.py", True),
           "seqpar": ("bench_seqpar.py", True), "fallback": ("bench_fallback.py", True),
           "after_gemm": ("bench_after_gemm.py", False)}
#: columns of the wide rows that are not a case's us per call
_NOT_CASES = ("M", "H", "MB", "rs_kernel", "outputs_match")


def parse_tree(text: str) -> tuple[str, str]:
    """'name=path' -> (name, absolute path); main() checks that it holds the benchmark."""
    name, sep, path = text.partition("=")
    if not sep or not name or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"--tree takes name=path (name a Python identifier), got {text!r}")
    return name, os.path.abspath(path)


def run_round(name: str, path: str, rnd: int, bench_args: list[str], runs_dir: str,
              timeout_s: float, bench: str = "single_gpu", nproc: int = 2) -> str:
    """One bench run of tree `name` from its checkout; returns its JSON path."""
    out = os.path.join(runs_dir, f"{name}_r{rnd}")
    env = dict(os.environ, DISTNORM_KERNEL_CACHE=os.path.join(runs_dir, f"kernel_cache_{name}"))
    script, multi = BENCHES[bench]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
              if multi else [sys.executable])
    note = [] if multi else ["--note", f"{name} round {rnd}"]  # only bench_single_gpu takes it
    cmd = [*launch, os.path.join(path, "benchmarks", script), *bench_args, "--out", out, *note]
    with open(out + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=path, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{name} round {rnd} failed (rc {proc.returncode}): see {out}.log")
    print(f"{name} round {rnd} done", flush=True)
    return out + ".json"


def merge_rounds(results: dict[str, list[str]]) -> list[dict]:
    """{tree: [JSON path per round]} -> rows {variant, M, H, <tree>_us: [us per round]}."""
    rows: dict[tuple, dict] = {}
    for name, paths in results.items():
        for path in paths:
            with open(path) as f:
                for variant, M, H, us in _points(json.load(f)["rows"]):
                    row = rows.setdefault((variant, M, H), dict(variant=variant, M=M, H=H))
                    row.setdefault(f"{name}_us", []).append(us)
    return [rows[k] for k in sorted(rows)]


def _points(rows: list[dict]):
    """(variant, M, H, us) of a benchmark's rows: long rows {variant, M, H, us} as they are,
    bench_after_gemm's rows one point per marginal column, wide rows (a column per case) one point
    per numeric case column; cases that did not run (None) are left out."""
    for r in rows:
        if "variant" in r and "us" in r:
            yield r["variant"], r["M"], r["H"], r["us"]
            continue
        if "variant" in r:  # bench_after_gemm: the norm's marginal times, the GEMM's K in the name
            for k, v in r.items():
                if k.endswith("_marginal"):
                    yield f"{r['variant']}_K{r['K']}_{k[:-len('_marginal')]}", r["M"], r["H"], v
            continue
        for k, v in r.items():
            if (k not in _NOT_CASES and not k.startswith("GB/s") and isinstance(v, (int, float))
                    and not isinstance(v, bool)):
                yield k, r["M"], r["H"], v


def run_environment(first_run_json: str) -> dict:
    """Where the A/B ran: device, torch and date from its first run's meta (when the benchmark
    records them), and the CuTe DSL of this process (the trees share the environment)."""
    from importlib import metadata

    with open(first_run_json) as f:
        run_meta = json.load(f).get("meta", {})
    env = {k: run_meta[k] for k in ("device", "torch", "date") if k in run_meta}
    try:
        env["cute_dsl"] = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        env["cute_dsl"] = "not installed"
    return env


def table(rows: list[dict], trees: list[str]) -> str:
    """Markdown: us per round for each tree, then each later tree's change of the mean."""
    base = trees[0]
    head = (["variant", "M", "H"] + trees + [f"{t} vs {base}" for t in trees[1:]])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["variant"], str(r["M"]), str(r["H"])]
        cells += [" / ".join(f"{u:.2f}" for u in r.get(f"{t}_us", [])) for t in trees]
        for t in trees[1:]:
            a, b = r.get(f"{t}_us"), r.get(f"{base}_us")
            cells.append(f"{100 * (statistics.mean(a) / statistics.mean(b) - 1):+.1f}%"
                         if a and b else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=parse_tree, action="append", required=True,
                   help="name=path of a checkout; the first is the base (give at least two)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--timeout-s", type=float, default=600, help="per bench run (default 600)")
    p.add_argument("--bench", choices=sorted(BENCHES), default="single_gpu",
                   help="which benchmark (default single_gpu)")
    p.add_argument("--nproc", type=int, default=2,
                   help="processes (GPUs) of a multi-GPU benchmark (default 2)")
    args = p.parse_args(own)
    script = BENCHES[args.bench][0]
    for name, path in args.tree:
        if not os.path.isfile(os.path.join(path, "benchmarks", script)):
            p.error(f"--tree {name}={path}: no benchmarks/{script}")
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    names = [n for n, _ in args.tree]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error(f"--tree: give at least two trees with different names, got {names}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if "--out" in bench_args or "--note" in bench_args:
        p.error("--out / --note after -- are set by ab_trees.py per run")
    runs_dir = args.out + "_runs"
    os.makedirs(runs_dir, exist_ok=True)
    results: dict[str, list[str]] = {n: [] for n in names}
    for rnd in range(1, args.rounds + 1):
        for name, path in args.tree:
            results[name].append(run_round(name, path, rnd, bench_args, runs_dir, args.timeout_s,
                                           args.bench, args.nproc))
    rows = merge_rounds(results)
    meta = dict(trees={n: p_ for n, p_ in args.tree}, rounds=args.rounds,
                command="python benchmarks/ab_trees.py " + " ".join(sys.argv[1:]),
                environment=run_environment(results[names[0]][0]))
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    text = table(rows, names)
    with open(args.out + ".md", "w") as f:
        where = ", ".join(f"{k} {v}" for k, v in meta["environment"].items())
        f.write(f"# A/B of {', '.join(names)}\n\n`{meta['command']}`\n\nRan on: {where}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
