"""The benchmarks that have not yet run on the GPUs they are written for run their cases here first,
on the CPU (gloo ranks, a CPU workspace), so their first GPU run does not fail on a call they make:
benchmarks/bench_seqpar.py (`--smoke`: its output check and every distnorm case once) and
benchmarks/bench_fallback.py (each path once)."""
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
        assert len(cases) == 44 and all(r[k] == 0.0 for k in cases), r
    picked = bench_seqpar.main(["--smoke", "--tokens", "2", "--hidden", "256", "--formats",
                                "fp8pt", "--cases", "^dn_rs_fp8pt_gather$"])
    assert picked[0]["outputs_match"], picked
    assert [k for k in picked[0] if k.startswith("dn_")] == ["dn_rs_fp8pt_gather"], picked
    capped = bench_seqpar.main(["--smoke", "--tokens", "2", "--hidden", "256", "--formats", "fp8",
                                "--rs-ctas", "4", "--cases", "_c4$"])
    assert [k for k in capped[0] if k.startswith("dn_")] == ["dn_rs_fp8_gather_c4"], capped


def test_seqpar_benchmark_cases_run():
    spawn(_seqpar_smoke, 2, timeout_s=300, cpu_only=True)


def _fallback_smoke() -> None:
    sys.path.insert(0, BENCHMARKS)
    import bench_fallback
    import torch

    import distnorm

    torch.manual_seed(0)  # the same weights and residual on every rank
    w = torch.rand(256).to(torch.bfloat16) + 0.5
    res = torch.randn(5, 256).to(torch.bfloat16)
    import torch.distributed as dist
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(dist.get_rank())).bfloat16()
    with distnorm.Workspace(device="cpu", buffer_bytes=4096) as peer, \
            distnorm.Workspace(backend="none", device="cpu", buffer_bytes=4096) as nccl:
        outs = {name: fn() for name, fn in bench_fallback._callables(x, res, w, peer, nccl,
                                                                     None).items()}
    assert set(outs) == set(bench_fallback.PATHS + bench_fallback.PARTS)
    for name in ("peer", "nopeer", "gather", "split", "split-h", "allgather"):
        if name != "allgather":  # it runs the kernel on h: no residual output
            assert torch.equal(outs[name].residual, outs["split"].residual), name
        assert torch.equal(outs[name].q.view(torch.uint8), outs["split"].q.view(torch.uint8)), name


def test_fallback_benchmark_cases_run():
    """benchmarks/bench_fallback.py's paths, once each on gloo ranks: the distnorm ones agree."""
    spawn(_fallback_smoke, 2, timeout_s=300, cpu_only=True)


class _FakeWorkspace:
    """Just the op-state store of a Workspace (what the benchmark's apply_tuning touches)."""

    def __init__(self) -> None:
        self.states: dict = {}

    def op_state(self, name, factory):
        return self.states.setdefault(name, factory())


def test_allreduce_benchmark_tuning_reaches_the_workspace(monkeypatch):
    """bench_allreduce_fusion.py's --tuning NAME:k=v,... variants set every knob they name on the
    workspace's Tuning (whose setter drops the calls planned under the last one)."""
    for name in ("DISTNORM_TWOSHOT_FORM", "DISTNORM_LAMPORT_FORM", "DISTNORM_PDL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_allreduce_fusion as bench

    ws = _FakeWorkspace()
    bench.apply_tuning(ws, {"form": "pull", "lform": "poll-unseen", "ctas": "24", "pdl": "0",
                            "rpcts": "1"})
    t = ws.states["allreduce"].tuning
    assert (t.twoshot_form, t.lamport_form, t.pdl, t.rows_per_cta["twoshot"]) == \
        ("pull", "poll-unseen", False, 1)
    assert t.ctas("twoshot", 132) == t.ctas("lamport", 132) == 24
    bench.apply_tuning(ws, {})
    t = ws.states["allreduce"].tuning
    assert (t.twoshot_form, t.lamport_form, t.ctas("twoshot", 132)) == ("auto", "poll-all", 132)


FAKE_BENCH = '''import json, os, sys
a = sys.argv
out = a[a.index("--out") + 1]
us = float(open(os.path.join(os.getcwd(), "US")).read())  # the tree's own number: run from its checkout
row = dict(variant="nvfp4", M=1, H=4096, us=us, args=a[1:], cache=os.environ["DISTNORM_KERNEL_CACHE"])
json.dump(dict(meta=dict(device="FakeGPU", date="2026-12-02"), rows=[row]), open(out + ".json", "w"))
'''


def test_ab_trees_alternates_the_trees_and_merges_their_rounds(tmp_path):
    """benchmarks/ab_trees.py: each tree's bench runs from its own checkout with its own kernel
    cache, the arguments after -- reach it, the rounds are merged per point, and a bad --tree is a
    one-line error."""
    import json
    import subprocess

    for name, us in (("kc_base", "2.0"), ("kc_new", "1.5")):
        (tmp_path / name / "benchmarks").mkdir(parents=True)
        (tmp_path / name / "benchmarks" / "bench_single_gpu.py").write_text(FAKE_BENCH)
        (tmp_path / name / "US").write_text(us)
    out = tmp_path / "ab"
    cmd = [sys.executable, os.path.join(BENCHMARKS, "ab_trees.py"), "--tree",
           f"base={tmp_path / 'kc_base'}", "--tree", f"new={tmp_path / 'kc_new'}", "--rounds", "2",
           "--out", str(out), "--", "--no-compile", "--Ms", "1"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert rows == [dict(variant="nvfp4", M=1, H=4096, base_us=[2.0, 2.0], new_us=[1.5, 1.5])]
    assert "| nvfp4 | 1 | 4096 | 2.00 / 2.00 | 1.50 / 1.50 | -25.0% |" in (tmp_path / "ab.md").read_text()
    assert "Ran on: device FakeGPU, date 2026-12-02, cute_dsl " in (tmp_path / "ab.md").read_text()
    runs = {t: json.loads((tmp_path / "ab_runs" / f"{t}_r2.json").read_text())["rows"][0]
            for t in ("base", "new")}
    assert runs["new"]["args"][:3] == ["--no-compile", "--Ms", "1"] and "--note" in runs["new"]["args"]
    assert runs["base"]["cache"] != runs["new"]["cache"]
    bad = subprocess.run(cmd[:3] + [f"base={tmp_path}"] + cmd[4:], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no benchmarks/bench_single_gpu.py" in bad.stderr


def test_ab_trees_reads_the_wide_rows_of_the_multi_gpu_benchmarks():
    """A multi-GPU benchmark's row has a column per case: one point per numeric case column, its
    flags, sizes and GB/s left out, a case that did not run (None) too; bench_after_gemm's rows
    a point per marginal time, named with the GEMM's K."""
    sys.path.insert(0, BENCHMARKS)
    import ab_trees

    wide = [{"M": 128, "H": 4096, "MB": 1.0, "rs_kernel": True, "outputs_match": True,
             "dn_fp8_lamport": 7.5, "nccl_ar": 15, "symm2": None, "GB/s fp8": 39.9}]
    assert list(ab_trees._points(wide)) == [("dn_fp8_lamport", 128, 4096, 7.5),
                                            ("nccl_ar", 128, 4096, 15)]
    long = [{"variant": "fp8", "M": 1, "H": 4096, "us": 2.0}]
    assert list(ab_trees._points(long)) == [("fp8", 1, 4096, 2.0)]
    assert ab_trees.BENCHES["allreduce_fusion"] == ("bench_allreduce_fusion.py", True)
    after_gemm = [{"variant": "fp8", "M": 8, "H": 8192, "K": 14336, "gemm": 58.5, "dn_pdl": 60.5,
                   "dn_pdl_marginal": 2.0, "dn_nopdl_marginal": 2.5}]
    assert list(ab_trees._points(after_gemm)) == [("fp8_K14336_dn_pdl", 8, 8192, 2.0),
                                                  ("fp8_K14336_dn_nopdl", 8, 8192, 2.5)]
    assert ab_trees.BENCHES["after_gemm"] == ("bench_after_gemm.py", False)
