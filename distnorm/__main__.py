"""`python -m distnorm` (or `distnorm`): check every format variant of the fused ops against
distnorm.reference and time them.

- One GPU: distnorm.add_rmsnorm, checked and timed (CUDA graph + events, median).
- Two or more GPUs: also the fused all-reduce distnorm.allreduce_add_rmsnorm, one process per GPU
  (self-spawned; under torchrun / mpirun on the launched ranks), checked against the reference and
  timed against NCCL all_reduce + add_rmsnorm.
- No GPU: the reference path on the CPU (the kernels are not exercised), no timing.
Exit code 0 when every check passes, 1 when one fails, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from distnorm.demo.cases import DTYPES, DemoConfig, blocks_text, select_cases, split_by_hidden
from distnorm.formats import MAX_HIDDEN, MIN_HIDDEN, VEC

PROG = "distnorm"


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit code 2 (argparse's default also prints usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option; description and epilog printed as written."""


def _variants_epilog() -> str:
    lines = ["format variants (--variants; from distnorm.formats.format_variants):"]
    lines += [f"  {c.name:26s} H a multiple of {c.hidden_multiple}" for c in select_cases()]
    lines.append(f"H must be in [{MIN_HIDDEN}, {MAX_HIDDEN}]; variants whose block does not divide "
                 "H are skipped with a note.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = _OneLineErrorParser(prog=PROG, description=__doc__, epilog=_variants_epilog(),
                             formatter_class=_HelpFormatter)
    ap.add_argument("-m", "--tokens", type=int, default=128, help="rows M (tokens); 0 is allowed")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    ap.add_argument("--variants", nargs="+", metavar="NAME", default=["all"],
                    help="run only these variants, space or comma separated")
    ap.add_argument("--iters", type=int, default=20,
                    help="timed CUDA-graph replays per measurement (the median is shown)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--no-multigpu", action="store_true",
                    help="skip the fused all-reduce even with >= 2 GPUs")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple:
    """(DemoConfig, cases that fit H, notes about skipped variants, args). Bad arguments end in
    the parser's one-line error (SystemExit(2))."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.tokens < 0:
        ap.error(f"-m/--tokens must be >= 0, got {args.tokens}")
    if not MIN_HIDDEN <= args.hidden <= MAX_HIDDEN or args.hidden % VEC:
        ap.error(f"--hidden must be a multiple of {VEC} in [{MIN_HIDDEN}, {MAX_HIDDEN}], "
                 f"got {args.hidden}")
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    names = tuple(n for item in args.variants for n in item.split(",") if n and n != "all")
    try:
        cases = select_cases(names)
    except ValueError as e:
        ap.error(f"--variants: {e}")
    fit, skipped = split_by_hidden(cases, args.hidden)
    if not fit:
        ap.error(f"--hidden {args.hidden} is not a multiple of the block of any chosen variant: "
                 f"{blocks_text(skipped)}")
    cfg = DemoConfig(args.tokens, args.hidden, args.dtype, args.iters, args.seed)
    notes = [f"skipped, H={args.hidden} is not a multiple of their block: {blocks_text(skipped)}"
             ] if skipped else []
    return cfg, fit, notes, args


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the main job; returns the exit code (0 all checks pass, 1 a check failed, 2 bad args)."""
    try:
        cfg, cases, notes, args = parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2): argparse already printed why
        return int(e.code or 0)
    from distnorm.demo.multigpu import run_multigpu
    from distnorm.demo.single import run_single
    from distnorm.launch import detect_launch_env

    env, gpus = detect_launch_env(), _gpu_count()
    launched = env.is_multiprocess and env.world_size > 1  # torchrun / mpirun started the ranks
    if launched:
        if gpus >= env.local_world_size and not args.no_multigpu:
            return 1 if run_multigpu(cfg, cases, env.world_size) else 0
        if env.rank != 0:
            return 0
        why = "--no-multigpu" if args.no_multigpu else f"needs a GPU per rank, torch sees {gpus}"
        print(f"{env.launcher} started {env.world_size} ranks but the fused all-reduce is not run "
              f"({why}): rank 0 runs the single-device check", flush=True)
    for note in notes:
        print(note, flush=True)
    rows = run_single(cfg, cases, "cuda" if gpus else "cpu")
    failures = sum(not r.ok for r in rows)
    if gpus and not args.no_multigpu and not launched:
        if gpus >= 2 and not env.is_multiprocess:
            failures += run_multigpu(cfg, cases, gpus)
        else:
            why = (f"{env.launcher} started 1 rank" if env.is_multiprocess
                   else "torch sees 1 GPU")
            print(f"\nfused all-reduce not run: it needs >= 2 ranks, one per GPU ({why})",
                  flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
