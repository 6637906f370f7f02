"""One device: every selected variant of distnorm.add_rmsnorm checked against distnorm.reference
and, on a GPU, timed (CUDA graph + events, median). On the CPU the op runs the reference itself,
so this only checks the reference path, and nothing is timed."""
from __future__ import annotations

import torch

import distnorm
from distnorm.demo.cases import EPS, DemoConfig, make_inputs, quant_kwargs
from distnorm.demo.check import CheckResult, compare
from distnorm.demo.table import Row, footnote, format_row, header, summary
from distnorm.demo.timing import CALLS_PER_GRAPH, time_us
from distnorm.reference import add_rmsnorm_ref


def run_case(cfg: DemoConfig, case, index: int, device: str) -> Row:
    """Check (and on a GPU with M > 0, time) one variant of add_rmsnorm."""
    x, residual, weight = make_inputs(cfg, index, device)
    kw = quant_kwargs(case, device)
    try:
        out = distnorm.add_rmsnorm(x, residual, weight, EPS, **kw)
        result = compare(out, add_rmsnorm_ref(x, residual, weight, EPS, **kw), case.spec)
    except Exception as e:  # noqa: BLE001 - one variant's failure is a FAIL row, not the end
        result = CheckResult(False, 0.0, f"{type(e).__name__}: {e}")
    if device == "cpu":
        return Row(case.name, result.ok, result.match, problem=result.problem)
    us, graph = None, True
    if cfg.tokens > 0 and result.ok:  # M = 0 is a valid call, but there is nothing to time
        us, graph = time_us(lambda: distnorm.add_rmsnorm(x, residual, weight, EPS, **kw), cfg.iters)
    return Row(case.name, result.ok, result.match, (us,), graph, result.problem)


def run_single(cfg: DemoConfig, cases: list, device: str) -> list:
    """Print the table row by row (flushed as each variant finishes) and return the rows."""
    columns = () if device == "cpu" else ("add_rmsnorm",)
    shape = f"M={cfg.tokens}, H={cfg.hidden}, {cfg.dtype}"
    if device == "cpu":
        print(f"single device, CPU ({shape}): checks the reference path only, the kernels are not "
              "exercised; no timing", flush=True)
    else:
        print(f"single GPU, {torch.cuda.get_device_name()} ({shape}): distnorm.add_rmsnorm, "
              f"us per call (CUDA graph of {CALLS_PER_GRAPH} calls, median of {cfg.iters} "
              "replays)", flush=True)
    print(header(columns), flush=True)
    rows = []
    for index, case in enumerate(cases):
        rows.append(run_case(cfg, case, index, device))
        print(format_row(rows[-1]), flush=True)
    if columns and footnote(rows):
        print(footnote(rows))
    what = "variants (CPU reference path)" if device == "cpu" else "single-GPU variants"
    print(summary(rows, what), flush=True)
    return rows
