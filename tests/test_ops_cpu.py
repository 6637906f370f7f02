"""CPU tests of the user-facing ops: bad input gets a clear error naming the argument; the CPU path
(the reference) matches distnorm.reference; the ops trace under torch.compile(fullgraph=True)."""
from __future__ import annotations

import types

import pytest
import torch

import distnorm
from distnorm.reference import add_rmsnorm_ref


def _inputs(M=5, H=512, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype)
    res = torch.randn(M, H, generator=g).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    return x, res, w


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"quant": "int8"}, ValueError, "quant"),
    ({"quant": "fp8"}, ValueError, "scale"),
    ({"quant": "nvfp4"}, ValueError, "global_scale"),
    ({"quant": "fp8_per_group", "group_size": 32}, ValueError, "group_size"),
    ({"quant": "nvfp4", "global_scale": torch.tensor([1.0]), "sf_layout": "tiled"}, ValueError, "sf_layout"),
    ({"quant": "fp8", "scale": 0.5}, TypeError, "scale"),
    ({"quant": "fp8", "scale": torch.tensor([1.0, 2.0])}, ValueError, "scale"),
    ({"eps": -1.0}, ValueError, "eps"),
])
def test_add_rmsnorm_option_errors(kwargs, exc, match):
    x, res, w = _inputs()
    with pytest.raises(exc, match=match):
        distnorm.add_rmsnorm(x, res, w, **kwargs)


def test_add_rmsnorm_tensor_errors():
    x, res, w = _inputs()
    with pytest.raises(ValueError, match="x must be a \\[..., H\\] tensor, got a 0-d"):
        distnorm.add_rmsnorm(x[0, 0], None, w)
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        distnorm.add_rmsnorm(x.float(), None, w.float())
    with pytest.raises(ValueError, match="residual"):
        distnorm.add_rmsnorm(x, res[:3], w)
    with pytest.raises(ValueError, match="residual"):
        distnorm.add_rmsnorm(x, res.half(), w)
    with pytest.raises(ValueError, match="weight"):
        distnorm.add_rmsnorm(x, res, w[:100])
    with pytest.raises(ValueError, match="hidden size"):
        distnorm.add_rmsnorm(x[:, :100], None, w[:100])
    with pytest.raises(ValueError, match="hidden size"):  # nvfp4 needs H % 16 == 0
        xs, _, ws = _inputs(H=264)
        distnorm.add_rmsnorm(xs, None, ws, quant="nvfp4", global_scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="residual_out"):
        distnorm.add_rmsnorm(x, res, w, residual_out=torch.empty(5, 256, dtype=x.dtype))
    with pytest.raises(ValueError, match="scales_out"):
        distnorm.add_rmsnorm(x, res, w, quant="fp8_per_token", scales_out=torch.empty(5, 2))


@pytest.mark.parametrize("quant, extra", [(None, {}), ("fp8_per_token", {}),
                                          ("nvfp4", {"global_scale": torch.tensor([100.0])}),
                                          ("mxfp4", {"sf_layout": "linear"})])
def test_cpu_path_is_the_reference_and_in_place_works(quant, extra):
    x, res, w = _inputs(M=7, H=1024, seed=3)
    ref = add_rmsnorm_ref(x, res, w, 1e-6, quant=quant, norm_out=True, **extra)
    res_in = res.clone()
    out = distnorm.add_rmsnorm(x, res_in, w, 1e-6, quant=quant, norm_out=True, residual_out=res_in, **extra)
    assert out.residual is res_in and torch.equal(res_in, ref.residual)
    assert torch.equal(out.y, ref.y)
    if quant is not None:
        assert torch.equal(out.q.view(torch.uint8), ref.q.view(torch.uint8))
        assert torch.equal(out.scales.view(torch.uint8), ref.scales.view(torch.uint8))


def test_zero_tokens():
    x, res, w = _inputs(M=0)
    out = distnorm.add_rmsnorm(x, res, w, quant="fp8_per_group")
    assert out.q.shape == (0, 512) and out.scales.shape == (0, 4) and out.residual.shape == (0, 512)


def test_compile_fullgraph_cpu():
    x, res, w = _inputs(M=4, H=768, seed=5)
    f = torch.compile(lambda a, b, c: distnorm.add_rmsnorm(a, b, c, 1e-6, quant="mxfp8"), fullgraph=True)
    out = f(x, res, w)
    ref = add_rmsnorm_ref(x, res, w, 1e-6, quant="mxfp8")
    assert torch.equal(out.q.view(torch.uint8), ref.q.view(torch.uint8))
    assert torch.equal(out.scales, ref.scales)


def test_allreduce_argument_errors():
    x, res, w = _inputs()
    with pytest.raises(TypeError, match="workspace"):
        distnorm.allreduce_add_rmsnorm(x, res, w, workspace=None)
    with pytest.raises(ValueError, match="algo"):
        distnorm.allreduce_add_rmsnorm(x, res, w, workspace=types.SimpleNamespace(world_size=2), algo="ring")
    with pytest.raises(TypeError, match="distnorm.Workspace"):
        distnorm.allreduce(x, workspace=types.SimpleNamespace(world_size=2))
    closed = object.__new__(distnorm.Workspace)  # what a closed workspace looks like to the ops
    closed._closed = True
    with pytest.raises(RuntimeError, match="closed"):
        distnorm.allreduce(x, workspace=closed)
    with pytest.raises(ValueError, match="algo"):
        distnorm.allreduce(x, workspace=types.SimpleNamespace(world_size=2), algo="ring")
    with pytest.raises(ValueError, match="scale"):
        distnorm.allreduce_add_rmsnorm(x, res, w, workspace=types.SimpleNamespace(world_size=2), quant="fp8")


def test_split_rows_never_when_an_output_starts_at_an_input():
    """NOTE [split rows]: a row split over CTAs must not be written over while another part loads it."""
    from distnorm.formats import make_quant_spec
    from distnorm.ops import _writes_where_it_reads, fused_kernel_key

    x, res = torch.randn(4, 64), torch.randn(4, 64)
    y, h = torch.empty_like(x), torch.empty_like(res)
    assert not _writes_where_it_reads(x, res, h, y, None)
    assert _writes_where_it_reads(x, res, res, y, None)  # residual updated in place
    assert _writes_where_it_reads(x, res, h, x, None)  # y over x (vLLM's in-place form)
    assert _writes_where_it_reads(x, None, None, x[:2], None)  # a view starting at x
    assert _writes_where_it_reads(x, res, None, None, res)  # q over residual
    spec = make_quant_spec("nvfp4")
    assert fused_kernel_key(torch.bfloat16, 4096, spec, True, False, True, 1).split == 4
    assert fused_kernel_key(torch.bfloat16, 4096, spec, True, False, True, 1, in_place=True).split == 1
    assert fused_kernel_key(torch.bfloat16, 4096, spec, True, False, True, 4099).split == 1
    # rows spread over a cluster are split too, fewer parts as rows grow (ops._split_rows)
    long_rows = [fused_kernel_key(torch.bfloat16, 32768, s, True, False, True, M).split
                 for s in (spec, make_quant_spec("fp8_per_group"), make_quant_spec("fp8_per_token"))
                 for M in (1, 8, 9, 16, 17, 48)]
    assert long_rows == [4, 4, 1, 1, 1, 1, 4, 4, 2, 2, 1, 1, 2, 2, 1, 1, 1, 1]
    # rows on one CTA: FP8 with one scale per row (static, per-token) from H = 8192 in 4 parts up
    # to 16 rows (static up to 32), then 2; below 8192 in 2
    short_rows = [fused_kernel_key(torch.bfloat16, H, make_quant_spec(k), True, False, True, M).split
                  for k, H in (("fp8", 8192), ("fp8", 4096), ("fp8_per_token", 12288),
                               ("fp8_per_token", 6144))
                  for M in (1, 8, 16, 17, 32, 33, 48, 49)]
    assert short_rows == [4, 4, 4, 4, 4, 2, 2, 1, 2, 2, 2, 2, 2, 2, 2, 1,
                          4, 4, 4, 2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 2, 2, 1]


def test_one_cta_per_sm_only_for_swizzled_split_rows_that_fit_the_sms(monkeypatch):
    """NOTE [one CTA per SM]: 18-31 rows, swizzled block scales, one CTA per row in parts, from
    H = 8192, where the grid fits the SMs (132 here: an H200's; with 114 none fits);
    DISTNORM_ONE_CTA_PER_SM=0 turns it off."""
    from distnorm import ops
    from distnorm.formats import make_quant_spec
    from distnorm.ops import fused_kernel_key

    monkeypatch.setattr(ops, "_sm_count", lambda: 132)
    ops._one_cta_per_sm.cache_clear()

    def flag(quant, H, M, in_place=False, **opts):
        spec = make_quant_spec(quant, **opts)
        return fused_kernel_key(torch.bfloat16, H, spec, True, False, False, M, in_place).one_cta_per_sm

    assert [flag("nvfp4", 12288, M) for M in (1, 16, 17, 18, 19, 24, 31, 32, 33, 48)] == \
        [False, False, False, True, True, True, True, False, False, False]
    assert flag("mxfp8", 8192, 24) and flag("mxfp4", 8192, 18) and flag("nvfp4", 14336, 31)
    assert not flag("nvfp4", 4096, 24)  # measured mixed (-3.6..+5%)
    assert not flag("nvfp4", 16384, 24)  # rows spread over a cluster, not split
    assert not flag("nvfp4", 12288, 24, sf_layout="linear")  # no padding CTAs
    assert not flag("fp8_per_token", 12288, 24) and not flag("fp8", 12288, 24)
    assert not flag("nvfp4", 12288, 24, in_place=True)  # one CTA per row, not split
    key = fused_kernel_key(torch.bfloat16, 12288, make_quant_spec("nvfp4"), True, False, False, 24,
                           slots=2)
    assert (key.split, key.slots, key.one_cta_per_sm) == (4, 2, True)
    monkeypatch.setenv("DISTNORM_ONE_CTA_PER_SM", "0")
    assert not flag("nvfp4", 12288, 24)
    monkeypatch.delenv("DISTNORM_ONE_CTA_PER_SM")
    monkeypatch.setattr(ops, "_sm_count", lambda: 114)  # an H100 PCIe: 4 x 31 + 8 CTAs do not fit
    ops._one_cta_per_sm.cache_clear()
    assert not flag("nvfp4", 12288, 24)
    ops._one_cta_per_sm.cache_clear()


def test_in_place_calls_compile_only_the_kernel_they_launch(monkeypatch):
    """An in-place decode call (split rows refused) compiles the one-CTA kernel only; the split
    kernel compiles when a call that may split comes, and each compiles once."""
    pytest.importorskip("cutlass")
    import distnorm.kernels.compile as kernel_compile
    from distnorm import ops

    compiled, launched = [], []

    def fake_compile(*key):
        key = ops.FusedKernelKey(*key)
        assert key.slots == 1  # x [M, H]
        compiled.append(key.split)
        return lambda *args: launched.append(key.split)

    monkeypatch.setattr(kernel_compile, "compiled_fused_norm", fake_compile)
    ops.clear_kernel_caches()
    try:
        x, res = torch.randn(4, 4096).bfloat16(), torch.randn(4, 4096).bfloat16()
        w = torch.ones(4096).bfloat16()
        for _ in range(2):  # in place: y over x, residual updated
            ops.run_fused_norm_kernel(x, res, w, 1e-6, None, None, None, False, res, x, None, None)
        assert compiled == [1] and launched == [1, 1]
        for _ in range(2):
            ops.run_fused_norm_kernel(x, res, w, 1e-6, None, None, None, False,
                                      torch.empty_like(res), torch.empty_like(x), None, None)
        assert compiled == [1, 4] and launched == [1, 1, 4, 4]
    finally:
        ops.clear_kernel_caches()


def test_kernel_checked_call_keeps_in_place_calls_unsplit(monkeypatch):
    """The eager CUDA path (ops._launch_kernel_checked, CPU tensors, faked kernel) takes the same
    kernel as run_fused_norm_kernel: unsplit rows when an output passed in starts at an input
    (vLLM's in-place form), split rows when it allocated every output."""
    pytest.importorskip("cutlass")
    import distnorm.kernels.compile as kernel_compile
    from distnorm import ops

    launched = []
    monkeypatch.setattr(kernel_compile, "compiled_fused_norm",
                        lambda *key: (lambda *args: launched.append(ops.FusedKernelKey(*key).split)))
    ops.clear_kernel_caches()
    try:
        x, res = torch.randn(4, 4096).bfloat16(), torch.randn(4, 4096).bfloat16()
        w = torch.ones(4096).bfloat16()

        def call(residual_out, y_out):
            return ops._launch_kernel_checked(x, res, w, 1e-6, None, 128, "swizzled", "row",
                                              False, None, None, False, False, residual_out,
                                              y_out, None, None)
        assert call(res, x) is not None and launched == [1]  # in place: one CTA per row
        assert call(None, None) is not None and launched == [1, 4]  # allocated: split rows
    finally:
        ops.clear_kernel_caches()


def test_kernel_checked_call_allocates_launches_and_falls_back(monkeypatch):
    """ops._launch_kernel_checked (the eager CUDA path, here on CPU tensors with a faked kernel):
    outputs of the format's shapes and dtypes, the format's own scalar only, and None (the checked
    path) whenever it cannot vouch for the call: the kernel entry refusing, eps, a missing scalar,
    no rows, a scales output of other strides."""
    pytest.importorskip("cutlass")
    import distnorm.kernels.compile as kernel_compile
    from distnorm import ops
    from distnorm.formats import make_quant_spec, scales_geometry

    calls, refuse = [], []

    def fake_compile(*key):
        def kernel(*args):
            if refuse:
                raise ValueError("Mismatched Tensor on argument #0")  # as the TVM-FFI entry says
            calls.append(args)
        return kernel

    monkeypatch.setattr(kernel_compile, "compiled_fused_norm", fake_compile)
    ops.clear_kernel_caches()
    try:
        M, H = 3, 512
        x, res = torch.randn(M, H).bfloat16(), torch.randn(M, H).bfloat16()
        w = torch.ones(H).bfloat16()
        gs, s = torch.tensor([200.0]), torch.tensor([0.05])
        spec = make_quant_spec("nvfp4")

        def call(quant, scale, global_scale, norm_out=False, eps=1e-6, rows=M, scales_out=None):
            return ops._launch_kernel_checked(x[:rows], res[:rows], w, eps, quant, 128,
                                              "swizzled", "row", False, scale, global_scale,
                                              False, norm_out, None, None, None, scales_out)
        out = call("nvfp4", s, gs)
        assert out.residual.shape == (M, H) and out.residual.dtype == x.dtype and out.y is None
        assert out.q.shape == (M, H // 2) and out.q.dtype == torch.uint8
        geo = scales_geometry(spec, M, H)
        assert (out.scales.shape, out.scales.stride(), out.scales.dtype) == geo
        args = calls[-1]
        assert args[7] is None and args[8] is gs and args[9] == 1e-6  # scale dropped: not nvfp4's
        fp8 = call("fp8", s, gs, norm_out=True)
        assert fp8.q.dtype == torch.float8_e4m3fn and fp8.y.shape == (M, H) and fp8.scales is s
        assert calls[-1][7] is s and calls[-1][8] is None
        n = len(calls)
        for eps in (1, float("nan"), -1.0):
            assert call("nvfp4", None, gs, eps=eps) is None
        assert call("nvfp4", None, None) is None  # global_scale missing
        assert call("nvfp4", None, gs, rows=0) is None  # no rows
        assert call("nvfp5", None, gs) is None  # a format make_quant_spec refuses
        bad_scales = torch.empty_strided(geo[0], (1, geo[0][0]), dtype=geo[2])
        assert call("nvfp4", None, gs, scales_out=bad_scales) is None
        assert len(calls) == n  # none of these launched
        refuse.append(True)
        assert call("nvfp4", None, gs) is None
    finally:
        ops.clear_kernel_caches()
