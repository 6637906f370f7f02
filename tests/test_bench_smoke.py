"""The benchmarks that have not yet run on the GPUs they are written for run their cases here first,
on the CPU (gloo ranks, a CPU workspace), so their first GPU run does not fail on a call they make:
benchmarks/bench_seqpar.py (`--smoke`: its output check and every distnorm case once)."""
from __future__ import annotations

import os
import sys

from distnorm.launch import spawn

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _seqpar_smoke() -> None:
    sys.path.insert(0, BENCHMARKS)
    import bench_seqpar

    rows = bench_seqpar.main(["--smoke", "--tokens", "2", "130", "--hidden", "256"])
    assert [(r["M"], r["H"]) for r in rows] == [(2, 256), (130, 256)]
    for r in rows:
        assert r["outputs_match"], r
        cases = [k for k in r if k.startswith("dn_")]
        assert len(cases) == 6 and all(r[k] == 0.0 for k in cases), r


def test_seqpar_benchmark_cases_run():
    spawn(_seqpar_smoke, 2, timeout_s=300, cpu_only=True)
