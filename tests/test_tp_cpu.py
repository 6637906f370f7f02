"""distnorm.tp and the TP example (examples/tp_llama.py) on the CPU: two gloo ranks, a CPU
workspace. The example's three forms (plain torch, distnorm.tp modules, torch compiled with the
fusion pass) must agree after two layers within a stated bound, and the pass must fuse exactly two
sites per layer. The GPU run of the same comparison: tests/multigpu/test_tp_gpu.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from cute_compile import skip_inductor_cpu_check_where_a_gpu_is
from distnorm.launch import spawn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))

def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes per-row scales (2.13 does; 2.11's mkldnn
    path takes per-tensor scales only)."""
    a = torch.zeros(2, 32, dtype=torch.float8_e4m3fn)
    b = torch.zeros(16, 32, dtype=torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


ROWWISE = _cpu_rowwise_scaled_mm()
NO_ROWWISE = f"torch {torch.__version__}: CPU torch._scaled_mm takes per-tensor scales only"

# relative error of the final residual against plain torch after 2 layers (tiny model): bf16
# rounding of a differently ordered sum, FP8 rounding of y in float32 instead of bf16
BOUNDS = {False: 2e-2, True: 6e-2}


def _body_example(fp8: bool, decode: bool) -> None:
    from dataclasses import replace

    import distnorm
    import torch.distributed as dist
    from tp_llama import MODELS, Config, compare_forms

    ws = distnorm.Workspace(dist.group.WORLD, device="cpu")
    cfg = replace(Config(**MODELS["tiny"]), fp8=fp8)
    got = compare_forms(cfg, 2, 4 if decode else 16, decode, ws, torch.device("cpu"))
    ws.close()
    assert len(got["sites"]) == 4 and not got["skipped"], got
    assert got["rel_distnorm"] < BOUNDS[fp8] and got["rel_pass"] < BOUNDS[fp8], got
    assert got["seqpar_vs_distnorm"], got  # the sequence-parallel stack: distnorm.tp's bits
    assert got["rel_seqpar"] == got["rel_distnorm"], got


@pytest.mark.parametrize("fp8, decode", [(False, True), (True, False)])
def test_tp_example_forms_agree(fp8, decode):
    skip_inductor_cpu_check_where_a_gpu_is()
    if fp8 and not ROWWISE:
        pytest.skip(NO_ROWWISE)
    spawn(_body_example, 2, fp8, decode, timeout_s=900, cpu_only=True)


def _body_modules() -> None:
    import torch.distributed as dist

    import distnorm
    from distnorm.reference import allreduce_add_rmsnorm_ref
    from distnorm.tp import AllReduceAddRMSNorm, RowParallelLinear

    ws = distnorm.Workspace(dist.group.WORLD, device="cpu")
    H, K = 256, 64
    torch.manual_seed(dist.get_rank())
    x = torch.randn(3, 5, K).to(torch.bfloat16)
    torch.manual_seed(0)
    residual = torch.randn(3, 5, H).to(torch.bfloat16)
    for quant, scale in ((None, None), ("fp8", 0.05), ("fp8_per_token", None)):
        norm = AllReduceAddRMSNorm(H, ws, 1e-6, quant=quant, scale=scale)
        norm.weight.data.uniform_(0.5, 1.5)
        down = RowParallelLinear(K, H, norm)
        out = down(x, residual)
        compiled = torch.compile(down, fullgraph=True)(x, residual)
        partial = torch.nn.functional.linear(x, down.weight)
        parts = [torch.empty_like(partial) for _ in range(2)]
        dist.all_gather(parts, partial)
        ref = allreduce_add_rmsnorm_ref([p.view(-1, H) for p in parts], residual.view(-1, H),
                                        norm.weight, 1e-6, quant=quant, scale=norm.scale)
        for got in (out, compiled):
            assert got.residual.shape == (3, 5, H)
            assert torch.equal(got.residual.view(-1, H), ref.residual), quant
            if quant is None:
                assert torch.equal(got.y.view(-1, H), ref.y)
            else:
                assert torch.equal(got.q.view(-1, H).view(torch.uint8), ref.q.view(torch.uint8))
                assert torch.equal(got.scales, ref.scales)
    ws.close()


def test_tp_modules_match_the_reference_eager_and_compiled():
    spawn(_body_modules, 2, timeout_s=600, cpu_only=True)


def _body_seqpar_module() -> None:
    """ReduceScatterAddRMSNorm against AllReduceAddRMSNorm on the same inputs, eager and compiled,
    gathered and not: the rank's residual rows and every row's y / q (partial's shape) and scales
    bitwise; poisoned inputs never reused (fresh random per format)."""
    import torch.distributed as dist

    import distnorm
    from distnorm.tp import AllReduceAddRMSNorm, ReduceScatterAddRMSNorm

    ws = distnorm.Workspace(dist.group.WORLD, device="cpu")
    H = 256
    for k, (quant, scale) in enumerate(((None, None), ("fp8", 0.05), ("fp8_per_token", None))):
        torch.manual_seed(100 * k + dist.get_rank())
        partial = torch.randn(3, 5, H).to(torch.bfloat16)  # 15 rows: shards of 8 and 7
        torch.manual_seed(100 * k)
        residual = torch.randn(3, 5, H).to(torch.bfloat16)
        weight = torch.rand(H).to(torch.bfloat16) + 0.5
        a, b = distnorm.shard_rows(15, ws)
        full = AllReduceAddRMSNorm(H, ws, 1e-6, quant=quant, scale=scale)
        full.weight.data.copy_(weight)
        want = full(partial, residual)
        for gather in (True, False):
            norm = ReduceScatterAddRMSNorm(H, ws, 1e-6, quant=quant, scale=scale, gather=gather)
            norm.weight.data.copy_(weight)
            rows = residual.view(-1, H)[a:b].clone()
            for got in (norm(partial, rows), torch.compile(norm, fullgraph=True)(partial, rows)):
                what = f"{quant} gather={gather}"
                assert torch.equal(got.residual, want.residual.view(-1, H)[a:b]), what
                mine = slice(None) if gather else slice(a, b)
                if quant is None:
                    assert got.y.shape == ((3, 5, H) if gather else (b - a, H)), what
                    assert torch.equal(got.y.reshape(-1, H), want.y.view(-1, H)[mine]), what
                    continue
                assert got.q.shape == ((3, 5, H) if gather else (b - a, H)), what
                assert torch.equal(got.q.reshape(-1, H).view(torch.uint8),
                                   want.q.view(-1, H)[mine].view(torch.uint8)), what
                want_s = want.scales if quant == "fp8" else want.scales[mine]
                assert torch.equal(got.scales, want_s), what
    ws.close()


def test_sequence_parallel_module_matches_the_all_reduce_module():
    skip_inductor_cpu_check_where_a_gpu_is()
    spawn(_body_seqpar_module, 2, timeout_s=600, cpu_only=True)


def test_fp8_linear_matches_a_dequantized_matmul():
    from distnorm.reference import add_rmsnorm_ref
    from distnorm.tp import fp8_linear, quantize_weight_fp8

    torch.manual_seed(0)
    w = torch.randn(48, 256).to(torch.bfloat16)
    w_t, w_s = quantize_weight_fp8(w)
    assert w_t.shape == (256, 48) and w_t.stride() == (1, 256) and w_s.shape == (1,)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    for quant, scale in (("fp8_per_token", None), ("fp8", torch.tensor([0.05]))):
        if quant == "fp8_per_token" and not ROWWISE:
            continue  # NO_ROWWISE; the per-tensor case still runs
        ref = add_rmsnorm_ref(x.view(-1, 256), None, torch.ones(256, dtype=torch.bfloat16),
                              quant=quant, scale=scale)
        s = ref.scales
        got = fp8_linear(ref.q.view(2, 3, 256), s, w_t, w_s)
        want = (ref.q.float() * s.float()) @ (w_t.float() * w_s)
        assert got.shape == (2, 3, 48)
        assert torch.allclose(got.float().view(-1, 48), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("module", ["AllReduceAddRMSNorm", "ReduceScatterAddRMSNorm"])
def test_module_argument_errors(module):
    import distnorm
    from distnorm import tp

    norm = getattr(tp, module)
    ws = object.__new__(distnorm.Workspace)
    with pytest.raises(ValueError, match="quant must be one of"):
        norm(256, ws, quant="nvfp4")
    with pytest.raises(ValueError, match="scale .* is required for quant='fp8'"):
        norm(256, ws, quant="fp8")
    with pytest.raises(ValueError, match="scale must be a finite float > 0"):
        norm(256, ws, quant="fp8", scale=-1.0)
    with pytest.raises(TypeError, match="distnorm.Workspace"):
        norm(256, "ws")
    with pytest.raises(ValueError, match="hidden size H=100"):
        norm(100, ws)
    with pytest.raises(TypeError, match="hidden must be an int"):
        norm("4096", ws)
    with pytest.raises(ValueError, match="eps must be a finite float"):
        norm(256, ws, eps=-1e-6)
    with pytest.raises(ValueError, match="scale must be a finite float > 0"):
        norm(256, ws, quant="fp8", scale=True)
    if module == "AllReduceAddRMSNorm":
        with pytest.raises(ValueError, match="algo must be one of"):
            norm(256, ws, algo="ring")
    # a string flag is truthy: the module would run gemma's (1 + w) or return y unasked
    with pytest.raises(TypeError, match="gemma must be a bool"):
        norm(256, ws, gemma="False")
    with pytest.raises(TypeError, match="norm_out must be a bool"):
        norm(256, ws, norm_out="no")
    if module == "ReduceScatterAddRMSNorm":
        with pytest.raises(TypeError, match="gather must be a bool"):
            norm(256, ws, gather="False")
