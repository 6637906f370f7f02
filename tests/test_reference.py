"""CPU tests that pin down docs/SEMANTICS.md: conversions, layouts, formats and the reference ops.

Independent checks are written differently from the code under test on purpose: rounding against
explicitly enumerated grids, the swizzle against a tile-by-tile Python loop, whole formats against
a scalar numpy float32 implementation.
"""

import bisect
import math

import numpy as np
import pytest
import torch

from distnorm.formats import (
    amax_nan, div_f32, e2m1_codes,
    e2m1_values, e4m3_rn_satfinite, from_swizzled, make_quant_spec, pack_fp4, rcp, round_up_pow2_bits, swizzle_into, swizzled_offset, to_swizzled, ue8m0_code,
    ue8m0_inverse, ue8m0_value, unpack_fp4,
)
from distnorm.reference import (
    dequantize, quantize_ref,
)

F = np.float32
NAN, INF = float("nan"), float("inf")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def f32(vals):
    return torch.tensor(vals, dtype=torch.float32)


def f32_from_bits(bits):
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


# ---- independent scalar models ----

# Non-negative e4m3 values in code order (code = 8*exponent + mantissa; 127 is NaN).
E4M3_POS = [m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            for e in range(16) for m in range(8)][:127]
E2M1_POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even_index(grid, a):
    """Index of the grid value nearest to a (a >= 0), ties to the even index, saturating."""
    if a >= grid[-1]:
        return len(grid) - 1
    i = bisect.bisect_right(grid, a) - 1
    dlo, dhi = a - grid[i], grid[i + 1] - a
    if dlo != dhi:
        return i if dlo < dhi else i + 1
    return i if i % 2 == 0 else i + 1


def slow_e4m3_byte(v):
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    if math.isnan(v):
        return sign | 0x7F
    return sign | nearest_even_index(E4M3_POS, abs(v))


def slow_e2m1_code(v):
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    return sign | (0 if math.isnan(v) else nearest_even_index(E2M1_POS, abs(v)))


def slow_ue8m0(v):
    """Smallest power of two >= v in UE8M0, via frexp (v = f * 2^e, 0.5 <= f < 1)."""
    if math.isnan(v) or math.isinf(v):
        return 255
    if v == 0:
        return 0
    f, e = math.frexp(v)
    p = e - 1 if f == 0.5 else e
    return min(max(p + 127, 1), 255)


def e4m3_decode(byte):
    v = E4M3_POS[byte & 0x7F] if (byte & 0x7F) != 0x7F else NAN
    return -v if byte & 0x80 else v


def slow_quantize(y, spec, scale=None, gs=None):
    """Scalar numpy-float32 model of one format on a finite y: (element codes/bytes, scales)."""
    M, H = y.shape
    g = H if spec.kind in ("fp8", "fp8_per_token") else spec.group_size
    codes, scales = np.zeros((M, H), np.int64), np.zeros((M, H // g), np.float64)
    for m in range(M):
        for b in range(H // g):
            blk = [F(v) for v in y[m, b * g:(b + 1) * g]]
            bmax = F(max(abs(v) for v in blk))
            if spec.kind == "fp8":
                mul, enc, sc = F(1) / F(scale), slow_e4m3_byte, scale
            elif spec.kind in ("fp8_per_token", "fp8_per_group"):
                s = F(max(bmax, F(1e-10))) / F(448)
                if spec.scale_ue8m0:
                    s = F(2.0 ** (slow_ue8m0(float(s)) - 127))
                mul, enc, sc = F(1) / s, slow_e4m3_byte, s
            elif spec.kind == "nvfp4":
                sc = slow_e4m3_byte(float(F(gs) * (bmax * (F(1) / F(6)))))
                sfv = F(e4m3_decode(sc))
                mul = F(0) if sfv == 0 else F(1) / (sfv * (F(1) / F(gs)))
                enc = slow_e2m1_code
            else:
                sc = slow_ue8m0(float(bmax / F(448 if spec.kind == "mxfp8" else 6)))
                mul = F(2.0 ** (127 - sc))
                enc = slow_e4m3_byte if spec.kind == "mxfp8" else slow_e2m1_code
            scales[m, b] = sc
            for j, v in enumerate(blk):
                codes[m, b * g + j] = enc(float(v * mul))
    return codes, scales


def q_codes(q, spec):
    """Element codes of q as int64 [M, H] (e4m3 bytes or e2m1 nibbles)."""
    return (unpack_fp4(q) if spec.packed_fp4 else q.view(torch.uint8)).long()


def slow_swizzle(linear, M, K):
    """Swizzled bytes built tile by tile: a 512-byte tile per (128-row block, 4-column block),
    32 lines of 16 bytes; line r holds rows r, r+32, r+64, r+96 of the block, 4 columns each."""
    Mp, Kp = -(-M // 128) * 128, -(-K // 4) * 4
    out = []
    for tile_m in range(Mp // 128):
        for tile_k in range(Kp // 4):
            for r in range(32):
                for j in range(4):
                    for kk in range(4):
                        m, k = tile_m * 128 + j * 32 + r, tile_k * 4 + kk
                        out.append(linear[m][k] if m < M and k < K else 0)
    return out


def rand_y(seed, M, H):
    """float32 normed-like activations, rows at very different magnitudes."""
    y = torch.randn(M, H, generator=gen(seed))
    return y * (10.0 ** torch.linspace(-3, 3, M)).unsqueeze(1)


# ---- conversions ----

def test_e2m1_table_ties_saturation_sign_nan():
    vals = [0.0, 0.25, 0.2500001, 0.5, 0.75, 0.7499999, 1.0, 1.25, 1.2500001, 1.5, 1.75, 2.0, 2.5,
            2.5000002, 3.0, 3.5, 3.4999998, 4.0, 5.0, 5.0000005, 6.0, 7.0, 1e30, INF]
    want = [0, 0, 1, 1, 2, 1, 2, 2, 3, 3, 4, 4, 4, 5, 5, 6, 5, 6, 6, 7, 7, 7, 7, 7]
    assert e2m1_codes(f32(vals)).tolist() == want
    assert e2m1_codes(-f32(vals)).tolist() == [8 | c for c in want]  # -0.0 -> 8
    nan_codes = e2m1_codes(torch.stack([f32([NAN])[0], -f32([NAN])[0]])).tolist()
    assert nan_codes == [0, 8]  # NaN: magnitude 0, sign from the sign bit
    assert e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == (
        E2M1_POS + [-v for v in E2M1_POS])
    assert torch.signbit(e2m1_values(torch.tensor([8], dtype=torch.uint8))).item()


def test_e2m1_matches_nearest_even_model():
    g = gen(1)
    mids = [(a + b) / 2 for a, b in zip(E2M1_POS, E2M1_POS[1:])]
    v = torch.cat([f32(E2M1_POS + mids), torch.rand(4000, generator=g) * 8,
                   torch.randn(1000, generator=g) * 3])
    v = torch.cat([v, torch.nextafter(v, f32([INF])), torch.nextafter(v, f32([0.0]))])
    assert e2m1_codes(v).tolist() == [slow_e2m1_code(x) for x in v.tolist()]


def test_e4m3_saturation_ties_nan():
    b = e4m3_rn_satfinite(f32([448, 449, 464, 479, 480, 1e9, INF, -449, -INF])).view(torch.uint8)
    assert b.tolist() == [0x7E] * 7 + [0xFE] * 2
    # RNE ties: between 1 and 1.125 -> 1 (mantissa 0); 1.1875 -> 1.25; subnormal 2^-10 -> 0,
    # 3*2^-10 -> 2^-8; 2^-11 -> 0.
    r = e4m3_rn_satfinite(f32([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11])).float()
    assert r.tolist() == [1.0, 1.25, 0.0, 2.0 ** -8, 0.0]
    assert torch.isnan(e4m3_rn_satfinite(f32([NAN])).float()).all()


def test_e4m3_matches_nearest_even_model():
    g = gen(2)
    grid = E4M3_POS
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    mags = 2.0 ** (torch.rand(6000, generator=g) * 24 - 13)  # 2^-13 .. 2^11
    v = torch.cat([f32(grid + mids), mags])
    v = torch.cat([v, torch.nextafter(v, f32([INF])), torch.nextafter(v, f32([0.0]))])
    v = torch.cat([v, -v])
    got = e4m3_rn_satfinite(v).view(torch.uint8).tolist()
    assert got == [slow_e4m3_byte(x) for x in v.tolist()]


def test_ue8m0_code_and_inverse():
    k = torch.arange(-126, 128)
    pow2 = torch.ldexp(torch.ones(k.shape), k)
    assert torch.equal(ue8m0_code(pow2).long(), k + 127)  # exact powers: 2^k -> k + 127
    above = torch.nextafter(pow2, f32([INF]))
    assert torch.equal(ue8m0_code(above[:-1]).long(), k[:-1] + 128)
    assert ue8m0_code(above[-1:]).item() == 255  # just above 2^127: capped
    sub = f32_from_bits([1, 0x400000, 0x7FFFFF])  # subnormals: smallest power >= is 2^-126
    assert ue8m0_code(sub).tolist() == [1, 1, 1]
    assert ue8m0_code(f32([0.0, NAN, INF, 3.0, 0.75])).tolist() == [0, 255, 255, 129, 127]
    g = gen(3)
    v = 2.0 ** (torch.rand(3000, generator=g) * 250 - 140)
    assert ue8m0_code(v).tolist() == [slow_ue8m0(x) for x in v.tolist()]

    c = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    inv, val = ue8m0_inverse(c), ue8m0_value(c)
    for i in range(255):
        assert inv[i].item() == math.ldexp(1.0, 127 - i), i
        assert val[i].item() == math.ldexp(1.0, i - 127), i
    assert inv.view(torch.int32)[254].item() == 0x400000  # 2^-127: subnormal, exact
    assert val.view(torch.int32)[0].item() == 0x400000
    assert math.isnan(inv[255].item()) and math.isnan(val[255].item())


def test_round_up_pow2_bits():
    v = f32([1.0, 1.5, 3.0, 0.75, 2.0 ** -20, 2.0 ** -20 * 1.0000001, 0.0, NAN, INF])
    want = [1.0, 2.0, 4.0, 1.0, 2.0 ** -20, 2.0 ** -19, 0.0]
    r = round_up_pow2_bits(v)
    assert r[:7].tolist() == want and math.isnan(r[7].item()) and r[8].item() == INF
    assert round_up_pow2_bits(f32_from_bits([5])).item() == 2.0 ** -126


def test_rcp_and_div_are_correctly_rounded():
    g = gen(4)
    v = 2.0 ** (torch.rand(20000, generator=g) * 200 - 100) * (1 + torch.rand(20000, generator=g))
    # float64 division then one rounding to float32 is correctly rounded (53 >= 2*24 + 2)
    assert torch.equal(rcp(v), (1.0 / v.double()).float())
    assert torch.equal(div_f32(v, 448.0), (v.double() / 448.0).float())
    assert torch.equal(div_f32(v, 6.0), (v.double() / 6.0).float())


def test_amax_nan_propagates():
    g = gen(5)
    t = torch.randn(4, 64, generator=g)
    t[0, 0], t[1, 31], t[2, 63] = NAN, NAN, -INF
    a = amax_nan(t, -1)
    assert torch.isnan(a[:2]).all() and a[2].item() == INF
    assert a[3].item() == t[3].abs().max().item()


def test_pack_unpack_fp4():
    codes = torch.randint(0, 16, (3, 64), generator=gen(6), dtype=torch.uint8)
    p = pack_fp4(codes)
    assert p.shape == (3, 32) and p.dtype == torch.uint8
    assert torch.equal(p[:, 0] & 0xF, codes[:, 0]) and torch.equal(p[:, 0] >> 4, codes[:, 1])
    assert torch.equal(unpack_fp4(p), codes)


# ---- swizzled layout ----

@pytest.mark.parametrize("M,K", [(1, 1), (5, 3), (128, 4), (129, 5), (300, 16), (0, 8)])
def test_swizzle_matches_tile_loop(M, K):
    lin = torch.randint(1, 256, (M, K), generator=gen(M * 100 + K), dtype=torch.uint8)
    sw = to_swizzled(lin)
    Mp, Kp = -(-M // 128) * 128, -(-K // 4) * 4
    assert sw.shape == (Mp, Kp) and sw.is_contiguous()
    assert sw.flatten().tolist() == slow_swizzle(lin.tolist(), M, K)
    assert torch.equal(from_swizzled(sw, M, K), lin)
    # the offset formula is a bijection onto [0, Mp*Kp) and agrees with the tensor layout
    m, k = torch.meshgrid(torch.arange(Mp), torch.arange(Kp), indexing="ij")
    off = swizzled_offset(m, k, K).flatten()  # k = K blocks per row, padded to Kp inside
    assert torch.equal(off.sort().values, torch.arange(Mp * Kp))
    if M:
        assert swizzled_offset(M - 1, K - 1, K) == int(off[(M - 1) * Kp + K - 1])
    padded = torch.zeros(Mp, Kp, dtype=torch.uint8)
    padded[:M, :K] = lin
    assert torch.equal(sw.flatten()[off], padded.flatten())  # padding bytes are zero
    f8 = to_swizzled(lin.view(torch.float8_e4m3fn))
    assert f8.dtype == torch.float8_e4m3fn and torch.equal(f8.view(torch.uint8), sw)
    # swizzle_into writes the same bytes into a poisoned tensor (one copy on whole tiles)
    for src in (lin, lin.view(torch.float8_e4m3fn)):
        out = torch.full((Mp, Kp), 0xA5, dtype=torch.uint8).view(src.dtype)
        swizzle_into(src, out)
        assert torch.equal(out.view(torch.uint8), sw)


@pytest.mark.parametrize("M,K,first", [(256, 8, 4), (128, 512, 4), (384, 4, 4), (300, 16, 8),
                                       (256, 8, 1), (300, 16, 2)])
def test_swizzle_into_whole_tiles_from_strided_rows(M, K, first):
    """swizzle_into's word copy: the linear rows taken from a wider tensor at column `first`
    (off 4-byte words at 1 and 2: the path through to_swizzled), a partial last tile at 300."""
    wide = torch.randint(1, 256, (M, K + 12), generator=gen(M + K), dtype=torch.uint8)
    lin = wide[:, first:first + K]
    out = torch.full((-(-M // 128) * 128, K), 0x5A, dtype=torch.uint8)
    swizzle_into(lin, out)
    assert torch.equal(out, to_swizzled(lin.contiguous()))


# ---- formats ----

SPECS = [make_quant_spec("fp8"), make_quant_spec("fp8_per_token"),
         make_quant_spec("fp8_per_group", group_size=128),
         make_quant_spec("fp8_per_group", group_size=64, scale_ue8m0=True, scale_major="col"),
         make_quant_spec("nvfp4", sf_layout="linear"), make_quant_spec("mxfp8", sf_layout="linear"),
         make_quant_spec("mxfp4", sf_layout="linear")]


def scale_args(y):
    amax = y.abs().max()
    return {"scale": (amax / 448).reshape(1), "global_scale": (448 * 6 / amax).reshape(1)}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}{s.group_size}{s.scale_ue8m0}")
def test_quantize_matches_scalar_model(spec):
    y = rand_y(7, 3, 256)
    sa = scale_args(y)
    q, scales = quantize_ref(y, spec, **sa)
    codes, sc = slow_quantize(y.numpy(), spec, scale=sa["scale"].item(), gs=sa["global_scale"].item())
    assert torch.equal(q_codes(q, spec), torch.from_numpy(codes))
    if spec.kind == "fp8":
        assert scales is sa["scale"]
    elif spec.kind == "nvfp4":
        assert scales.view(torch.uint8).long().tolist() == sc.astype(np.int64).tolist()
    else:
        assert scales.double().tolist() == sc.tolist()


def edge_case_rows():
    """Inputs where the exact operation order of SEMANTICS.md shows in the output bytes (found by a
    search over float32 values). Returns (y [3, 256], scale, global_scale)."""
    g = gen(17)
    y = torch.randn(3, 256, generator=g) * 1e-5
    # Row 0, nvfp4 with gs = 1234.5678. Blocks 0..2: bmax where gs * (bmax * rcp(6)) and
    # (gs * bmax) * rcp(6) round to different e4m3 scales.
    y[0, 0], y[0, 16], y[0, 32] = f32_from_bits([0x3C78D500, 0x3BF8D500, 0x3CF8D500])
    # Block 3: sf = 0.029296875, where rcp(sf * rcp(gs)) != gs / sf; these elements land on
    # either side of an e2m1 threshold depending on which one is used.
    crossing = f32_from_bits([0x36C710CE, 0x37954C99, 0x37F8D501, 0x382E2EB3, 0x3878D501,
                              0x38AE2EB3, 0x38F8D501])
    y[0, 48] = f32_from_bits([0x39154C99])
    y[0, 49:56], y[0, 56:63] = crossing, -crossing
    # Row 1: bmax 106.75 -> per-token s = 106.75 / 448 = 61/256 exactly; y = (e4m3 midpoint) * s
    # exactly, so y / s is a tie but y * rcp(s) is not (for half of them): rcp is visible.
    mids = [(a + b) / 2 for a, b in zip(E4M3_POS, E4M3_POS[1:])]
    y[1, 0] = 106.75
    y[1, 1:1 + len(mids)] = f32(mids) * (61 / 256)
    y[1, 128:128 + len(mids)] = -f32(mids) * (61 / 256)
    return y, f32([61 / 256]), f32([1234.5678])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}{s.group_size}{s.scale_ue8m0}")
def test_quantize_edge_cases_match_scalar_model(spec):
    y, scale, gs = edge_case_rows()
    q, scales = quantize_ref(y, spec, scale=scale, global_scale=gs)
    codes, sc = slow_quantize(y.numpy(), spec, scale=scale.item(), gs=gs.item())
    assert torch.equal(q_codes(q, spec), torch.from_numpy(codes))
    if spec.kind == "nvfp4":
        assert scales.view(torch.uint8).long().tolist() == sc.astype(np.int64).tolist()
    elif spec.kind != "fp8":
        assert scales.double().tolist() == sc.tolist()


def elem_bound(u, fp4):
    """Largest rounding error of one element u in the scaled domain.

    e4m3: round-to-nearest with 3 mantissa bits is off by at most half a step, 2^-4 |u| for
    normals, 2^-10 (half the 2^-9 subnormal step) below 2^-6. Saturation can only add the tiny
    excess of u over 448 that the rounded rcp allows, < 2^-4 |u|.
    e2m1: half the grid step around |u| (0.25 up to 2, 0.5 up to 4, 1 up to 6), or |u| - 6 when
    saturating (nvfp4: sf rounds down by up to 2^-4 relative, so |u| can reach ~6.4).
    """
    a = u.abs()
    if not fp4:
        return torch.maximum(a * 2.0 ** -4, torch.full_like(a, 2.0 ** -10))
    half = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)).double()
    return torch.maximum(half, a - 6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}{s.group_size}{s.scale_ue8m0}")
def test_round_trip_error_bound(spec):
    M, H = 12, 512
    y = rand_y(8, M, H)
    sa = scale_args(y)
    q, scales = quantize_ref(y, spec, **sa)
    d = dequantize(q, scales, spec, M=M, H=H, **sa)
    assert d.dtype == torch.float32 and d.shape == (M, H)
    # S: the dequant scale of each element, in float64
    ones = torch.ones(M, H)
    if spec.kind == "fp8":
        S = ones * sa["scale"]
    elif spec.kind == "fp8_per_token":
        S = ones * scales
    else:
        K = H // spec.group_size
        if spec.kind == "nvfp4":
            per = scales.float().double() / sa["global_scale"].double()
            assert (per == 0).any() and (per > 0).any()  # rows 1e6 apart: both cases occur
        elif spec.kind in ("mxfp8", "mxfp4"):
            per = ue8m0_value(scales).double()
        else:
            per = scales.double()
        S = per.reshape(M, K, 1).expand(M, K, spec.group_size).reshape(M, H)
    S = S.double()
    y64 = y.double()
    # rounding of y*rcp(S) and of the dequant multiplies adds a few 2^-24 relative: covered by the
    # (1 + 2^-16) slack and the 2^-20 |y| term
    tol = S * elem_bound(y64 / S, spec.packed_fp4) * (1 + 2.0 ** -16) + 2.0 ** -20 * y64.abs()
    if spec.kind == "nvfp4":
        # sf == 0 (gs * bmax / 6 rounded to e4m3 zero, i.e. <= 2^-10): q = 0, so the error is |y|,
        # at most bmax <= 6 * 2^-10 / gs
        tol = torch.where(S == 0, 6 * 2.0 ** -10 / sa["global_scale"].double() * (1 + 2.0 ** -16), tol)
    err = (d.double() - y64).abs()
    assert (err <= tol).all(), (err / tol).max().item()


def test_zero_blocks():
    y = torch.randn(3, 256, generator=gen(9))
    y[0] = 0.0
    y[1, :128] = 0.0  # one whole block of every format
    y[1, 16:32] = -0.0  # the sign of zero survives: e4m3 0x80, e2m1 code 8
    neg = torch.signbit(y)
    floor = div_f32(f32([1e-10]), 448.0).item()  # max(0, 1e-10) / 448
    for spec in SPECS[1:]:
        sa = {"global_scale": f32([1000.0])}
        q, scales = quantize_ref(y, spec, **sa)
        d = dequantize(q, scales, spec, **sa)
        assert not torch.isnan(d).any() and not torch.isnan(scales.float()).any()
        assert (d[0] == 0).all() and (d[1, :128] == 0).all()
        codes = q_codes(q, spec)
        zero_code = torch.where(neg, 8 if spec.packed_fp4 else 0x80, 0)
        assert torch.equal(codes[0], zero_code[0]) and torch.equal(codes[1, :128], zero_code[1, :128])
        if spec.kind == "fp8_per_token":
            assert scales[0, 0].item() == floor
        elif spec.kind == "fp8_per_group":
            want = round_up_pow2_bits(f32([floor])).item() if spec.scale_ue8m0 else floor
            assert (scales[0] == want).all() and scales[1, 0].item() == want
        else:  # nvfp4 sf 0, mx code 0
            k = 128 // spec.group_size
            assert (scales[0].view(torch.uint8) == 0).all()
            assert (scales[1, :k].view(torch.uint8) == 0).all()


def test_nan_and_inf_blocks():
    y = torch.randn(2, 256, generator=gen(10))
    y[0, 5], y[1, 40] = NAN, INF
    sa = {"global_scale": f32([100.0])}
    for spec in SPECS[1:]:
        q, scales = quantize_ref(y, spec, **sa)
        codes = q_codes(q, spec)
        if spec.kind == "fp8_per_token":
            assert torch.isnan(scales[0]).all() and scales[1, 0].item() == INF
            assert torch.isnan(q[0].float()).all()  # y * rcp(NaN)
            assert torch.isnan(q[1, 40].float()) and (q[1].float() == 0).sum() == 255  # rcp(inf) = 0
            continue
        g = spec.group_size
        bn, bi = 5 // g, 40 // g  # the blocks holding the NaN and the inf
        d = dequantize(q, scales, spec, **sa)
        lin = scales.reshape(2, -1)
        others = torch.ones(2, 256 // g, dtype=torch.bool)
        others[0, bn] = others[1, bi] = False
        if spec.kind == "fp8_per_group":
            assert torch.isnan(lin[0, bn]) and lin[1, bi].item() == INF
            assert torch.isfinite(lin[others]).all()
        elif spec.kind == "nvfp4":
            assert torch.isnan(lin[0, bn].float()) and lin[1, bi].float().item() == 448.0
            assert torch.isfinite(lin[others].float()).all()
            assert (codes[0, bn * g:(bn + 1) * g] & 7 == 0).all()  # e2m1(NaN): magnitude 0
            assert codes[1, 40].item() == 7  # inf -> 6
        else:  # mx: NaN and inf blocks get code 255 (a NaN scale)
            assert lin[0, bn].item() == 255 and lin[1, bi].item() == 255
            assert (lin[others] < 255).all()
            if spec.kind == "mxfp8":
                assert torch.isnan(q[1, bi * g:(bi + 1) * g].float()).all()
        assert torch.isnan(d[0, bn * g:(bn + 1) * g]).all()
        assert torch.isfinite(d[0, (bn + 1) * g:]).all()
