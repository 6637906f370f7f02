"""A/B of source trees on one GPU: `bench_single_gpu.py` run from each tree's own checkout (its own
code and kernel cache), the trees alternated for several rounds, then one table of us per call in
every round and each tree's change of the mean against the first tree. Alternating rounds in one
device call is what makes a 2-3% difference readable: the same point drifts by about that much
between device sessions (the unchanged kernels of an A/B are its noise floor: show them too).

    git worktree add --detach ../base main         # the tree to compare against
    python benchmarks/ab_trees.py --tree base=../base --tree new=. --rounds 2 \\
        --out benchmarks/results/my_change_ab_h200 -- --no-compile --Hs 4096 32768 --Ms 1 1024

Everything after `--` goes to bench_single_gpu.py. Writes <out>.md (the table) and <out>.json
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


def parse_tree(text: str) -> tuple[str, str]:
    """'name=path' -> (name, absolute path); the path must hold benchmarks/bench_single_gpu.py."""
    name, sep, path = text.partition("=")
    if not sep or not name or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"--tree takes name=path (name a Python identifier), got {text!r}")
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "benchmarks", "bench_single_gpu.py")):
        raise argparse.ArgumentTypeError(
            f"--tree {text!r}: no benchmarks/bench_single_gpu.py under {path}")
    return name, path


def run_round(name: str, path: str, rnd: int, bench_args: list[str], runs_dir: str,
              timeout_s: float) -> str:
    """One bench run of tree `name` from its checkout; returns its JSON path."""
    out = os.path.join(runs_dir, f"{name}_r{rnd}")
    env = dict(os.environ, DISTNORM_KERNEL_CACHE=os.path.join(runs_dir, f"kernel_cache_{name}"))
    cmd = [sys.executable, os.path.join(path, "benchmarks", "bench_single_gpu.py"), *bench_args,
           "--out", out, "--note", f"{name} round {rnd}"]
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
                for r in json.load(f)["rows"]:
                    key = (r["variant"], r["M"], r["H"])
                    row = rows.setdefault(key, dict(variant=r["variant"], M=r["M"], H=r["H"]))
                    row.setdefault(f"{name}_us", []).append(r["us"])
    return [rows[k] for k in sorted(rows)]


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
    args = p.parse_args(own)
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
            results[name].append(run_round(name, path, rnd, bench_args, runs_dir, args.timeout_s))
    rows = merge_rounds(results)
    meta = dict(trees={n: p_ for n, p_ in args.tree}, rounds=args.rounds,
                command="python benchmarks/ab_trees.py " + " ".join(sys.argv[1:]))
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    text = table(rows, names)
    with open(args.out + ".md", "w") as f:
        f.write(f"# A/B of {', '.join(names)}\n\n`{meta['command']}`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
