"""CPU tests that pin down docs/SEMANTICS.md for the reference ops: RMSNorm, the residual's one
rounding, the ordered all-reduce sum, the ops' outputs, shapes, layouts and strides, and argument
checking. (Conversions, layouts and formats: tests/test_reference.py, whose scalar models and
helpers these tests share.)
"""


import pytest
import torch

from distnorm.formats import (
    QUANT_KINDS, NormQuantOutput, QuantSpec, check_hidden, empty_scales, make_quant_spec, q_dtype,
    q_shape, scales_geometry,
)
from distnorm.reference import (
    add_rmsnorm_ref, allreduce_add_rmsnorm_ref, allreduce_ref, dequantize, quantize_ref, rmsnorm_ref,
)

from test_reference import f32, gen  # the shared helpers


# ---- norm, residual, all-reduce ----

@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_vs_float64(gemma):
    g = gen(11)
    x = (torch.randn(6, 1024, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(1024, generator=g).to(torch.bfloat16)
    y = rmsnorm_ref(x, w, 1e-6, gemma=gemma)
    x64 = x.double()
    w64 = w.double() + (1.0 if gemma else 0.0)
    y64 = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    # float32: mean square (pairwise sum, ~2^-20), rsqrt (<= 2 ulp), two products: well under 2^-18
    assert y.dtype == torch.float32
    assert ((y.double() - y64).abs() <= 2.0 ** -18 * y64.abs()).all()


def test_rmsnorm_operation_order():
    # Only the mean-square reduction order and rsqrt may differ in kernels; the rest is pinned:
    # r = rsqrt(ms + float32(eps)), y = (h * r) * w, two separately rounded products.
    g = gen(18)
    x = torch.randn(64, 512, generator=g).to(torch.float16)
    w = (torch.randn(512, generator=g) * 3).to(torch.float16)
    ms = x.float().square().mean(-1, keepdim=True)
    r = torch.rsqrt(ms + torch.tensor(1e-5, dtype=torch.float32))
    assert torch.equal(rmsnorm_ref(x, w, 1e-5), (x.float() * r) * w.float())
    assert torch.equal(rmsnorm_ref(x, w, 1e-5, gemma=True), (x.float() * r) * (1.0 + w.float()))
    assert not torch.equal(rmsnorm_ref(x, w, 1e-5), x.float() * (r * w.float()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_rounded_once(dtype):
    g = gen(12)
    xs = [torch.randn(8, 512, generator=g).to(dtype) for _ in range(4)]
    res = (torch.randn(8, 512, generator=g) * 4).to(dtype)
    w = torch.randn(512, generator=g).to(dtype)
    out = allreduce_add_rmsnorm_ref(xs, res, w, allreduce_out=True)
    exact = (sum(x.double() for x in xs) + res.double()).to(dtype)
    assert torch.equal(out.residual, exact)  # these float32 sums are exact: one rounding at the end
    twice = (sum(x.double() for x in xs).to(dtype).float() + res.float()).to(dtype)
    assert not torch.equal(out.residual, twice)  # rounding the sum first would show
    assert torch.equal(out.allreduce, allreduce_ref(xs))
    one = add_rmsnorm_ref(xs[0], res, w)
    assert torch.equal(one.residual, (xs[0].double() + res.double()).to(dtype))


def test_allreduce_is_the_ordered_float32_sum():
    g = gen(13)
    x0 = (torch.randn(4, 256, generator=g) * 2.0 ** 20).to(torch.bfloat16)
    x1 = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    xs = [x0, x1, -x0, (torch.randn(4, 256, generator=g)).to(torch.bfloat16)]
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    assert torch.equal(allreduce_ref(xs), acc.to(torch.bfloat16))
    other = ((xs[0].float() + xs[2].float()) + xs[1].float()) + xs[3].float()
    assert not torch.equal(acc, other)  # the order matters with these inputs, and is kept
    assert torch.equal(allreduce_ref(xs[:1]), x0)


def test_norm_quant_op_outputs():
    g = gen(14)
    x = torch.randn(5, 768, generator=g).to(torch.bfloat16)
    res = torch.randn(5, 768, generator=g).to(torch.bfloat16)
    w = torch.randn(768, generator=g).to(torch.bfloat16)
    plain = add_rmsnorm_ref(x, res, w, 1e-5)
    assert isinstance(plain, NormQuantOutput) and plain.q is None and plain.scales is None
    h = (x.float() + res.float()).to(torch.bfloat16)
    y = rmsnorm_ref(h, w, 1e-5)
    assert torch.equal(plain.residual, h) and torch.equal(plain.y, y.to(torch.bfloat16))
    gs = f32([50.0])
    o = add_rmsnorm_ref(x, res, w, 1e-5, quant="nvfp4", global_scale=gs, norm_out=True, gemma=True)
    qy, sy = quantize_ref(rmsnorm_ref(h, w, 1e-5, gemma=True), make_quant_spec("nvfp4"), global_scale=gs)
    assert torch.equal(o.q, qy) and torch.equal(o.scales.view(torch.uint8), sy.view(torch.uint8))
    assert o.y is not None and o.allreduce is None
    assert add_rmsnorm_ref(x, res, w, quant="fp8_per_token").y is None
    nores = add_rmsnorm_ref(x, None, w, quant="mxfp8")
    assert nores.residual is None
    assert torch.equal(nores.q.view(torch.uint8), quantize_ref(rmsnorm_ref(x, w, 1e-6), "mxfp8")[0].view(torch.uint8))
    # one rank: the all-reduce path is the single-GPU op
    for r in (res, None):
        a = allreduce_add_rmsnorm_ref([x], r, w, quant="fp8_per_group", norm_out=True)
        b = add_rmsnorm_ref(x, r, w, quant="fp8_per_group", norm_out=True)
        for f in ("residual", "y", "scales"):
            fa, fb = getattr(a, f), getattr(b, f)
            assert (fa is None and fb is None) or torch.equal(fa, fb)
        assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [0, 1, 130])
def test_shapes_layouts_strides(dtype, M):
    H = 512
    g = gen(15 + M)
    wide = torch.randn(M, H + 64, generator=g).to(dtype)
    x = wide[:, :H]  # strided rows
    res = torch.randn(M, H, generator=g).to(dtype)
    w = torch.randn(H, generator=g).to(dtype)
    sa = {"scale": f32([0.02]), "global_scale": f32([300.0])}
    for kind in QUANT_KINDS:
        outs = {}
        for lay, major in (("linear", "col"), ("swizzled", "row")):
            opts = dict(quant=kind, sf_layout=lay, scale_major=major, **sa)
            o = add_rmsnorm_ref(x, res, w, **opts)
            c = add_rmsnorm_ref(x.contiguous(), res, w, **opts)
            spec = make_quant_spec(kind, sf_layout=lay, scale_major=major)
            assert o.q.shape == q_shape(spec, M, H) and o.q.dtype == q_dtype(spec)
            assert torch.equal(o.q.view(torch.uint8), c.q.view(torch.uint8))
            geo = scales_geometry(spec, M, H)
            if geo is None:
                assert kind == "fp8" and o.scales is sa["scale"]
            else:
                assert (tuple(o.scales.shape), o.scales.stride(), o.scales.dtype) == geo
                e = empty_scales(spec, M, H, "cpu")
                assert (tuple(e.shape), e.stride(), e.dtype) == geo
            outs[lay] = dequantize(o.q, o.scales, spec, M=M, H=H, **sa)
            assert outs[lay].shape == (M, H)
        assert torch.equal(outs["linear"], outs["swizzled"])


# ---- argument checking ----

def test_make_quant_spec_and_check_hidden():
    assert make_quant_spec(None) is None
    assert make_quant_spec("fp8_per_token", group_size=7, sf_layout="x") == QuantSpec("fp8_per_token")
    s = make_quant_spec("nvfp4", scale_major="bad")
    assert (s.group_size, s.sf_layout, s.packed_fp4, s.block_scaled) == (16, "swizzled", True, True)
    assert make_quant_spec("mxfp8", sf_layout="linear").group_size == 32
    assert make_quant_spec("fp8_per_group", group_size=64).group_size == 64
    for kw, name in [(dict(quant="fp9"), "quant"),
                     (dict(quant="fp8_per_group", group_size=32), "group_size"),
                     (dict(quant="fp8_per_group", scale_major="diag"), "scale_major"),
                     (dict(quant="mxfp4", sf_layout="tiled"), "sf_layout")]:
        q = kw.pop("quant")
        with pytest.raises(ValueError, match=name):
            make_quant_spec(q, **kw)
    check_hidden(None, 256)
    check_hidden(None, 32768)
    check_hidden(make_quant_spec("fp8_per_group", group_size=64), 320)
    for spec, H in [(None, 248), (None, 32776), (None, 260), (make_quant_spec("nvfp4"), 264),
                    (make_quant_spec("mxfp8"), 272), (make_quant_spec("fp8_per_group"), 320)]:
        with pytest.raises(ValueError, match="hidden"):
            check_hidden(spec, H)


def test_op_argument_errors():
    g = gen(16)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(256, generator=g).to(torch.bfloat16)
    y = rmsnorm_ref(x, w, 1e-6)
    with pytest.raises(ValueError, match="scale"):
        add_rmsnorm_ref(x, None, w, quant="fp8")
    with pytest.raises(ValueError, match="scale"):
        quantize_ref(y, "fp8")
    with pytest.raises(ValueError, match="global_scale"):
        allreduce_add_rmsnorm_ref([x, x], x, w, quant="nvfp4")
    with pytest.raises(ValueError, match="global_scale"):
        quantize_ref(y, "nvfp4")
    with pytest.raises(ValueError, match="scale"):
        add_rmsnorm_ref(x, None, w, quant="fp8", scale=0.5)
    with pytest.raises(ValueError, match="quant"):
        add_rmsnorm_ref(x, None, w, quant="int8")
    with pytest.raises(ValueError, match="hidden"):
        add_rmsnorm_ref(x[:, :248], None, w[:248])
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm_ref(x, x.half(), w)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm_ref(x, None, w[:128])
    with pytest.raises(ValueError, match="x"):
        add_rmsnorm_ref(x.float(), None, w)
    with pytest.raises(ValueError, match="xs"):
        allreduce_ref([])
