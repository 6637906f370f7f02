"""CPU tests of the main job, `python -m distnorm` (distnorm/__main__.py, distnorm/demo/): its CPU
path in-process (main(argv) returns the exit code), argument errors, the checks and the table, and
the multi-GPU rank body's collective bookkeeping on gloo ranks with a CPU stand-in for the
workspace (the op then runs its CPU path; nothing is timed). The GPU paths need GPUs:
`python -m distnorm` on a machine with >= 2 GPUs, or `torchrun --nproc-per-node 2 -m distnorm`."""
from __future__ import annotations

import json

import pytest
import torch

import distnorm
from distnorm import __main__ as main_module
from distnorm.comm import Workspace
from distnorm.demo import multigpu, single
from distnorm.demo.cases import DemoConfig, make_inputs, quant_kwargs, select_cases, split_by_hidden
from distnorm.demo.check import FLOAT_SCALE_ULPS, compare
from distnorm.demo.table import Row, render
from distnorm.formats import FORMATS, format_variants
from distnorm.launch import spawn
from distnorm.reference import add_rmsnorm_ref

main = main_module.main
NAMES = [name for name, _, _ in format_variants()]

# With a GPU the job runs the kernels and times them: these tests are about the CPU path.
cpu_path = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the main job's CPU path")


def _rows(out: str) -> dict:
    """variant name -> the rest of its table line."""
    return {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in NAMES}


# --- the CPU path, in-process ---------------------------------------------------------------
@cpu_path
def test_small_run_checks_every_variant_without_timing(capsys):
    assert main(["-m", "8", "--hidden", "256"]) == 0
    out = capsys.readouterr().out
    assert "reference path only" in out and "not exercised" in out
    rows = _rows(out)
    assert sorted(rows) == sorted(NAMES)
    assert all(line.split()[1] == "ok" and len(line.split()) == 3 for line in rows.values())
    header = next(line for line in out.splitlines() if line.startswith("variant"))
    assert header.split() == ["variant", "check", "match", "%"]  # no timing column
    assert " us" not in out and "all 17 variants (CPU reference path) match" in out


@cpu_path
def test_zero_tokens_checks_shapes_only(capsys):
    assert main(["-m", "0"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert sorted(rows) == sorted(NAMES)
    assert all(line.split()[1:] == ["ok", "n/a"] for line in rows.values())


@cpu_path
def test_hidden_not_a_multiple_of_a_block_skips_those_variants(capsys):
    assert main(["-m", "3", "--hidden", "272", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    fit, skipped = split_by_hidden(select_cases(), 272)
    assert sorted(_rows(out)) == sorted(c.name for c in fit)
    note = next(line for line in out.splitlines() if line.startswith("skipped"))
    assert all(f"{c.name} ({c.hidden_multiple})" in note for c in skipped)
    assert {c.name for c in fit} == {"none", "fp8", "fp8_per_token", "nvfp4_linear",
                                     "nvfp4_swizzled"}


@cpu_path
def test_variants_subset_space_or_comma_separated(capsys):
    assert main(["-m", "2", "--variants", "fp8,nvfp4_linear", "none"]) == 0
    assert sorted(_rows(capsys.readouterr().out)) == ["fp8", "none", "nvfp4_linear"]


def test_help_lists_variants_and_defaults(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert f"  {name} " in out
    for default in ("(default: 128)", "(default: 4096)", "(default: bf16)", "(default: 20)"):
        assert default in out


@pytest.mark.parametrize("argv, words", [
    (["--hidden", "100"], "multiple of 8 in [256, 32768]"),
    (["--hidden", "40000"], "multiple of 8 in [256, 32768]"),
    (["--hidden", "260"], "multiple of 8"),
    (["--hidden", "264", "--variants", "mxfp8_linear"], "mxfp8_linear (32)"),
    (["-m", "-1"], "-m/--tokens must be >= 0"),
    (["-m", "x"], "invalid int value"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--variants", "nvfp8"], "unknown variant(s) nvfp8"),
    (["--dtype", "fp32"], "invalid choice"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_one_line_exit_2(capsys, argv, words):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distnorm: error:") and words in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


@cpu_path
def test_a_failing_check_gives_exit_1(capsys, monkeypatch):
    real = distnorm.add_rmsnorm

    def wrong_residual(*args, **kwargs):
        out = real(*args, **kwargs)
        out.residual.view(torch.int16)[0, 0] ^= 1  # one bit: the residual must be bitwise equal
        return out

    monkeypatch.setattr(distnorm, "add_rmsnorm", wrong_residual)
    assert main(["-m", "4", "--hidden", "256", "--variants", "fp8"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in _rows(out)["fp8"] and "residual differs" in out
    assert "1 of 1 variants (CPU reference path) differ" in out


# --- main's choice of path (the GPU paths replaced by recorders) ------------------------------
@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(single, "run_single", lambda cfg, cases, device: calls.append(
        ("single", device)) or [])
    monkeypatch.setattr(multigpu, "run_multigpu", lambda cfg, cases, n: calls.append(
        ("multigpu", n)) or 3)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return calls


@pytest.mark.parametrize("gpus, argv, expected, code", [
    (0, [], [("single", "cpu")], 0),
    (1, [], [("single", "cuda")], 0),
    (2, [], [("single", "cuda"), ("multigpu", 2)], 1),
    (4, ["--no-multigpu"], [("single", "cuda")], 0),
])
def test_path_by_gpu_count(monkeypatch, capsys, recorded, gpus, argv, expected, code):
    monkeypatch.setattr(main_module, "_gpu_count", lambda: gpus)
    assert main(argv) == code
    assert recorded == expected
    if gpus == 1:
        assert "needs >= 2 ranks" in capsys.readouterr().out


def test_under_a_launcher_the_ranks_run_the_all_reduce(monkeypatch, recorded):
    monkeypatch.setattr(main_module, "_gpu_count", lambda: 2)
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
                       ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    assert main([]) == 1
    assert recorded == [("multigpu", 2)]


# --- pieces ---------------------------------------------------------------------------------
def test_cases_come_from_format_variants():
    cases = select_cases()
    assert [c.name for c in cases] == NAMES
    for case in cases:
        kw = quant_kwargs(case, "cpu")
        scalar = FORMATS[case.quant or "none"].scalar
        assert {k for k in kw if k in ("scale", "global_scale")} == ({scalar} if scalar else set())


def test_inputs_random_nonzero_x_per_rank_residual_shared():
    cfg = DemoConfig(tokens=16, hidden=256)
    x0, r0, w0 = make_inputs(cfg, 0, "cpu", rank=0)
    x1, r1, w1 = make_inputs(cfg, 0, "cpu", rank=1)
    assert (x0 != 0).float().mean() > 0.99 and (w0 > 0).all()
    assert not torch.equal(x0, x1) and torch.equal(r0, r1) and torch.equal(w0, w1)
    assert not torch.equal(make_inputs(cfg, 1, "cpu")[0], x0)  # fresh inputs per case


def _ref_and_case(name, M=64, H=512):
    case = next(c for c in select_cases() if c.name == name)
    cfg = DemoConfig(tokens=M, hidden=H)
    x, res, w = make_inputs(cfg, 0, "cpu")
    ref = add_rmsnorm_ref(x, res, w, 1e-6, **quant_kwargs(case, "cpu"))
    return case, ref


def _copy(out):
    return out._replace(**{f: (t.clone() if isinstance(t, torch.Tensor) else t)
                           for f, t in out._asdict().items()})


def test_compare_bounds():
    case, ref = _ref_and_case("mxfp8_swizzled")
    assert compare(ref, ref, case.spec).ok
    one = _copy(ref)
    one.q.view(torch.uint8)[0, 0] ^= 1  # one code of 32768: within the 99.9% bound
    assert compare(one, ref, case.spec).ok
    many = _copy(ref)
    many.q.view(torch.uint8)[:, :64] ^= 1
    result = compare(many, ref, case.spec)
    assert not result.ok and "quantized codes" in result.problem
    scales = _copy(ref)
    scales.scales.view(torch.uint8)[0, 0] += 2  # two UE8M0 steps
    assert "scales differ by more than one step" in compare(scales, ref, case.spec).problem
    case, ref = _ref_and_case("fp8_per_group128_row")  # float32 scales: FLOAT_SCALE_ULPS relative
    for ulps, ok in ((FLOAT_SCALE_ULPS - 2, True), (2 * FLOAT_SCALE_ULPS, False)):
        nudged = _copy(ref)
        nudged.scales[0, 0] *= 1 + ulps * torch.finfo(torch.float32).eps
        problem = compare(nudged, ref, case.spec).problem
        assert ("float32 scales differ" in problem) != ok, (ulps, problem)
    case, ref = _ref_and_case("none")
    y = _copy(ref)
    y.y[0, 0] = y.y[0, 0] * 1.1
    assert "1 ulp" in compare(y, ref, None).problem
    assert "y:" in compare(ref._replace(y=ref.y[:1]), ref, None).problem


def test_table_timing_columns_and_speedup():
    rows = [Row("fp8", True, 1.0, (10.0, 25.0)), Row("nvfp4_linear", False, 0.5, (None, None),
                                                       graph=False, problem="bad")]
    text = render(rows, multigpu.TIME_COLUMNS, speedup=True)
    assert "fused us" in text and "nccl+norm us" in text and "2.50x" in text
    assert "n/a" in text and "FAIL" in text and "bad" in text and "* timed with eager" in text
    plain = render([Row("fp8", True, None)])
    assert " us" not in plain and "n/a" in plain
    assert (multigpu.progress_line(1, 2, rows[0])
            == "[1/2] fp8: ok, fused 10.00 us, nccl+norm 25.00 us")


# --- the multi-GPU rank body on gloo ranks ----------------------------------------------------
def _cpu_workspace(group):
    """A CPU workspace: the op takes its torch.distributed (gloo) + reference path."""
    return Workspace(group, device="cpu")


def _rank_body(cfg, cases, path, corrupt_rank):
    import torch.distributed as dist

    if dist.get_rank() == corrupt_rank:
        real = distnorm.allreduce_add_rmsnorm

        def corrupted(*args, **kwargs):
            out = real(*args, **kwargs)
            out.residual.view(torch.int16)[0, 0] ^= 1
            return out
        distnorm.allreduce_add_rmsnorm = corrupted
    failures = multigpu.rank_main(cfg, cases, path, _cpu_workspace)
    assert failures == (0 if corrupt_rank < 0 else len(cases))  # the same on every rank


@cpu_path
@pytest.mark.parametrize("corrupt_rank", [-1, 1])
def test_rank_main_on_gloo_ranks(tmp_path, capfd, corrupt_rank):
    path = str(tmp_path / "result.json")
    cases = select_cases(("none", "fp8", "nvfp4_swizzled"))
    spawn(_rank_body, 2, DemoConfig(tokens=5, hidden=256), cases, path, corrupt_rank, timeout_s=120)
    with open(path) as f:
        assert json.load(f) == {"failures": 0 if corrupt_rank < 0 else 3}
    out = capfd.readouterr().out
    assert "[3/3] nvfp4_swizzled: " in out and "no peer mappings (CPU workspace" in out
    if corrupt_rank < 0:
        assert "all 3 all-reduce variants on 2 ranks match" in out
    else:  # rank 0's outputs are right, rank 1's are not: every rank reports the failure
        assert "fails on another rank" in out and "3 of 3 all-reduce variants" in out
