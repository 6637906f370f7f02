"""Integer arithmetic the kernels run, checked on the CPU against the reference (the GPU tests
check the kernels themselves):
- e2m1 rounding by bit arithmetic (NormQuantCore._e2m1_biased_magnitude), emulated in torch,
  against formats.e2m1_codes: every float32 within 4096 ulps of each rounding threshold and grid
  value, the specials, and a million random patterns (run once over every float32 in [0, 6], where
  the clamp puts every input, when it was written: no mismatch); and whole FP4 words as _store_q
  packs them (biases removed once per word, signs by ptx.nibble_signs' byte permutes) against
  pack_fp4(e2m1_codes(v));
- the MX block code from amax's bits (BlockScales._ue8m0_of_quotient) against
  ue8m0_code(amax / elem_max);
- the packed 16-bit residual add (NormQuantCore.add_packed: one correct rounding of x + r) against
  the reference's float32 add then rounding;
- the swizzled-scale offset (formats.swizzled_offset, the very function the kernels call) against
  formats.to_swizzled;
- the lanes' exchange of block amaxes and multipliers (BlockScales._block_amax / _lane_value, the
  kernels' own code) on an emulated warp, against the block amax of each vector."""
import pytest
import torch

from distnorm.formats import (E2M1_GRID, E2M1_MAX, E4M3_MAX, e2m1_codes, pack_fp4, swizzled_offset,
                              swizzled_word_row, to_swizzled, ue8m0_code)
from distnorm.kernels.norm_quant import E2M1_CODE_BIAS, PACKED_E2M1_BIAS

THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def kernel_e2m1_biased(v: torch.Tensor) -> torch.Tensor:
    """What _e2m1_biased_magnitude computes, step by step (int64 so shifts are plain; the float32
    add is torch's, round-to-nearest-even like the GPU's)."""
    c = torch.nan_to_num(v.abs(), nan=0.0).clamp(0.0, 6.0)  # e2m1_clamp: max.f32(NaN, 0) = 0
    b = c.view(torch.int32).to(torch.int64)
    binade = b.clamp(min=0x3F800000) & 0x7F800000
    magic = (binade + 0x0B000000).to(torch.int32).view(torch.float32)
    rounded = (magic + c).view(torch.int32).to(torch.int64)
    return rounded - binade + (binade >> 22)


def kernel_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """One element's code: the biased magnitude less its bias, and v's sign bit at bit 3."""
    return (kernel_e2m1_biased(v) - E2M1_CODE_BIAS) | ((v.view(torch.int32).to(torch.int64) >> 28) & 0x8)


def kernel_fp4_words(v: torch.Tensor) -> torch.Tensor:
    """What _store_q writes for [n, 8] float32 values: the shifted biased magnitudes summed modulo
    2^32, PACKED_E2M1_BIAS taken off, and ptx.nibble_signs' byte permutes (uint32 in int64)."""
    biased = kernel_e2m1_biased(v)
    word = sum(biased[:, e] << (4 * e) for e in range(8))
    word = (word - PACKED_E2M1_BIAS) & 0xFFFFFFFF
    top = (v.view(torch.int32).to(torch.int64) >> 24) & 0xFF  # each value's top byte
    odd = sum(top[:, 2 * i + 1] << (8 * i) for i in range(4))  # prmt 0x73, 0x73, 0x5410
    even = sum(torch.where(top[:, 2 * i] >= 0x80, 0xFF, 0) << (8 * i) for i in range(4))  # 0xDC98
    return word | (odd & 0x80808080) | (even & 0x08080808)


def _around(values, ulps: int = 4096) -> torch.Tensor:
    centers = torch.tensor(values, dtype=torch.float32).view(torch.int32).to(torch.int64)
    offsets = torch.arange(-ulps, ulps + 1, dtype=torch.int64)
    return (centers[:, None] + offsets[None, :]).flatten().to(torch.int32).view(torch.float32)


def test_kernel_e2m1_arithmetic_matches_reference():
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 6.0,
                             7.0, 8.0, 1e30, 0.5, 1.0], dtype=torch.float32)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=g, dtype=torch.int64)
    samples = [specials, _around(THRESHOLDS + E2M1_GRID[1:]), rand.to(torch.int32).view(torch.float32)]
    for v in samples:
        for sign in (1.0, -1.0):
            vs = v * sign
            want = e2m1_codes(vs).to(torch.int64)
            got = kernel_e2m1_codes(vs)
            bad = (want != got).nonzero().flatten()
            assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {vs[bad[:4]].tolist()}"


def test_kernel_fp4_words_match_reference_packing():
    """Whole words: the biases taken off once per word and the signs placed by byte permutes give
    pack_fp4(e2m1_codes(v)) read as little-endian int32 words (every sign pattern, specials,
    threshold neighbours and random patterns in every nibble)."""
    g = torch.Generator().manual_seed(1)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 6.0,
                             -7.0, 0.25, -0.75, 1.25, 5.0, 2.5, -3.5, 1e-45, 1e30], dtype=torch.float32)
    near = _around(THRESHOLDS + E2M1_GRID[1:], ulps=64)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=g, dtype=torch.int64)
    pool = torch.cat([specials, near, -near, rand.to(torch.int32).view(torch.float32)])
    v = pool[torch.randint(0, pool.numel(), (1 << 18, 8), generator=g)]
    signs = torch.tensor([[(s >> e) & 1 for e in range(8)] for s in range(256)], dtype=torch.bool)
    v[:256] = torch.where(signs, -v[:256].abs(), v[:256].abs())  # every sign pattern
    want = pack_fp4(e2m1_codes(v)).contiguous().view(torch.int32).flatten().to(torch.int64) & 0xFFFFFFFF
    got = kernel_fp4_words(v)
    bad = (want != got).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatched words, e.g. {v[bad[:2]].tolist()}"


def kernel_ue8m0_of_quotient(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """What BlockScales._ue8m0_of_quotient computes (int64, so the add does not wrap)."""
    e_bits = int(torch.tensor(elem_max, dtype=torch.float32).view(torch.int32))
    b = amax.view(torch.int32).to(torch.int64)
    code = ((b + (0x7FFFFF - (e_bits & 0x7FFFFF))) >> 23) - ((e_bits >> 23) - 127)
    code = code.clamp(min=1)
    code = torch.where(b <= int(elem_max) // 2, 0, code)
    return torch.where(b >= 0x7F800000, 255, code)


@pytest.mark.parametrize("elem_max", [E4M3_MAX, E2M1_MAX])
def test_kernel_ue8m0_without_division_matches_reference(elem_max):
    """The MX block code from amax's bits equals ue8m0_code(amax / elem_max) (the reference's
    correctly rounded division): every exponent with mantissas around the carry threshold and the
    ends, subnormal amax around the zero threshold, specials, random non-negative patterns."""
    g = torch.Generator().manual_seed(2)
    e_bits = int(torch.tensor(elem_max, dtype=torch.float32).view(torch.int32))
    exps = torch.arange(0, 256, dtype=torch.int64)[:, None] << 23
    mants = torch.cat([torch.arange(0, 64), torch.arange(0x800000 - 64, 0x800000),
                       (e_bits & 0x7FFFFF) + torch.arange(-64, 65)]).to(torch.int64)[None, :]
    around = (exps + mants).flatten()
    tiny = torch.arange(0, 4096, dtype=torch.int64)
    rand = torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int64)
    b = torch.cat([around, tiny, rand, torch.tensor([0x7F800000, 0x7FC00000, 0x7FFFFFFF])])
    amax = b.to(torch.int32).view(torch.float32)
    want = ue8m0_code(amax / torch.tensor(elem_max, dtype=torch.float32)).to(torch.int64)
    got = kernel_ue8m0_of_quotient(amax, elem_max)
    bad = (want != got).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {amax[bad[:4]].tolist()}"


@pytest.mark.parametrize("M, K", [(1, 1), (5, 3), (128, 4), (130, 7), (300, 256), (257, 2048)])
def test_swizzled_offset_is_to_swizzled(M, K):
    linear = torch.arange(M * K, dtype=torch.int64).view(M, K)
    flat = to_swizzled(linear).flatten()
    row = torch.arange(M).view(M, 1).expand(M, K)
    blk = torch.arange(K).view(1, K).expand(M, K)
    assert torch.equal(flat[swizzled_offset(row, blk, K)], linear)
    Mp, Kp = (M + 127) // 128 * 128, (K + 3) // 4 * 4  # padding: the offsets cover the rest once
    prow = torch.arange(Mp).view(Mp, 1).expand(Mp, Kp)
    pblk = torch.arange(Kp).view(1, Kp).expand(Mp, Kp)
    assert torch.equal(swizzled_offset(prow, pblk, K).flatten().sort().values, torch.arange(Mp * Kp))


@pytest.mark.parametrize("K", [1, 3, 4, 7, 256, 2048])
def test_swizzled_word_row_is_swizzled_offset(K):
    """The padding CTAs' word -> row map (formats.swizzled_word_row, as the kernel calls it): word w
    of a tile starts at the offset of its row's block 4 * (w // 128), and every (row, group of 4
    blocks) of the tile has exactly one word."""
    kp4 = (K + 3) // 4
    w = torch.arange(kp4 * 128)
    row = swizzled_word_row(w)
    assert torch.equal(swizzled_offset(row, 4 * (w // 128), K), 4 * w)
    assert torch.equal((row * kp4 + w // 128).sort().values, torch.arange(kp4 * 128))


def _correctly_rounded(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values -> dtype with one round-to-nearest-even. Through float32, which is exact for
    the 16-bit sums here except far below a 16-bit ulp; where that float32 rounding landed exactly
    on a 16-bit midpoint, the neighbour on the exact value's side is the answer."""
    f32 = exact.to(torch.float32)
    err = exact - f32.double()
    near = f32.to(dtype)
    other = (2 * f32.double() - near.double())  # the other neighbour when f32 is a midpoint
    tie = (near.double() != f32.double()) & (other.to(dtype).double() == other) & (err != 0)
    side = torch.where(err > 0, torch.maximum(near.double(), other), torch.minimum(near.double(), other))
    return torch.where(tie, side.to(dtype), near)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_add_is_the_reference_add(dtype):
    """T(float32(x) + float32(r)) (the reference) is the correctly rounded x + r for every r and
    x of both signs in [1, 2) (the rounding depends on the exponent difference only, so this binade
    stands for all normal x) and x among the subnormals and at the top of the range: what
    add.rn.{bf16,f16}x2 computes. (Run once for every bf16 pair: no mismatch.)"""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    one = torch.tensor(1.0, dtype=dtype).view(torch.int16).item()
    mant = 128 if dtype == torch.bfloat16 else 1024
    xs = torch.arange(one, one + mant, dtype=torch.int32)
    xs = torch.cat([xs, torch.arange(1, 64, dtype=torch.int32),
                    torch.tensor([torch.finfo(dtype).max], dtype=dtype).view(torch.int16).to(torch.int32)
                    - torch.arange(0, 8, dtype=torch.int32)])
    xs = xs[torch.randperm(xs.numel(), generator=torch.Generator().manual_seed(1))[:256]]
    x = torch.cat([xs, xs | -32768]).to(torch.int16).view(dtype)
    r = every[~torch.isnan(every)]
    X, R = x[:, None].expand(-1, r.numel()), r[None, :].expand(x.numel(), -1)
    ref = (X.float() + R.float()).to(dtype)
    one_rounding = _correctly_rounded(X.double() + R.double(), dtype)
    same = (ref.view(torch.int16) == one_rounding.view(torch.int16)) | (torch.isnan(ref) & torch.isnan(one_rounding))
    assert bool(same.all()), f"{int((~same).sum())} pairs differ"


@pytest.mark.parametrize("lanes", [2, 4, 8, 16])
def test_block_amax_lane_exchange(monkeypatch, lanes):
    """BlockScales._block_amax / _lane_value (NOTE [one scale per lane]) run on an emulated warp:
    each op on a [32] array, one value per lane, shuffles as index gathers. Every lane must end
    with the amax of its vector's whole block (NaN kept), and read every vector's value of its
    group from the lane that computed it -- for every group size, not only the one in use."""
    import numpy as np

    from distnorm.formats import VEC
    from distnorm.kernels import block_scales, ptx

    lane = np.arange(32)
    monkeypatch.setattr(block_scales, "Float32", np.float32)
    monkeypatch.setattr(ptx, "fabs", np.abs)
    monkeypatch.setattr(ptx, "fmax_nan", np.maximum)  # NaN-propagating, as max.NaN
    monkeypatch.setattr(ptx, "select_f32", lambda pick, a, b: np.where(pick != 0, a, b))
    monkeypatch.setattr(block_scales.cute.arch, "shuffle_sync_bfly",
                        lambda v, offset, mask, mask_and_clamp: v[lane ^ offset])
    monkeypatch.setattr(block_scales.cute.arch, "shuffle_sync",
                        lambda v, offset, mask, mask_and_clamp: v[offset & 31])
    gen = np.random.default_rng(lanes)
    for nv in (1, 2, 3, 4, 8):
        rY = gen.standard_normal((nv * VEC, 32)).astype(np.float32)
        rY[gen.integers(0, nv * VEC), gen.integers(0, 32)] = np.nan
        # block amax of vector j for every lane: max over the lane's block of |y| of that vector
        own = np.abs(rY.reshape(nv, VEC, 32)).max(axis=1)  # [nv, 32]
        block = own.reshape(nv, 32 // lanes, lanes).max(axis=2).repeat(lanes, axis=1)  # [nv, 32]
        group = 1
        while group <= min(lanes, nv):
            if nv % group == 0:
                for j0 in range(0, nv, group):
                    amax = block_scales.BlockScales._block_amax(None, rY, j0, group, lanes, lane)
                    want = block[j0 + lane % group, lane]
                    assert np.array_equal(amax, want, equal_nan=True), (nv, group, j0)
                    for k in range(group):
                        got = block_scales.BlockScales._lane_value(None, amax, k, group, lane)
                        assert np.array_equal(got, block[j0 + k], equal_nan=True), (nv, group, k)
            group *= 2


@pytest.mark.parametrize("world, M, K", [(2, 256, 4), (2, 2048, 256), (4, 1000, 180),
                                         (8, 129, 512), (2, 3, 8), (4, 4099, 16)])
def test_gathered_swizzled_scale_words(world, M, K):
    """NOTE [swizzled scales gathered] in kernels/reducescatter.py, as the kernel addresses it, for
    shards of whole tiles or not: on every rank the epilogue writes row i of its shard at global row
    rank * S + i of the full output, the push reads those words back as the row's linear words,
    and the copy-out stores word w of another shard's row s * S + i at swizzled_offset(s * S + i,
    4w, K); padding words of rows past M are zeroed. Each rank's full output is then to_swizzled of
    the rows in order, every word written exactly once."""
    S, kw = -(-M // world), K // 4
    Mp = -(-M // 128) * 128
    linear = torch.randint(1, 1 << 30, (M, kw), dtype=torch.int64)  # a word per 4 blocks
    want = to_swizzled(linear.repeat_interleave(4, 1))[:, ::4].flatten()  # each word once
    for rank in range(world):
        full = torch.full((Mp * kw,), -1, dtype=torch.int64)  # this rank's output, poisoned
        writes = torch.zeros(Mp * kw, dtype=torch.int64)
        for s in range(world):
            rows = torch.arange(s * S, min(M, (s + 1) * S))
            r, w = rows.view(-1, 1).expand(-1, kw), torch.arange(kw).view(1, kw).expand(len(rows), kw)
            at = swizzled_offset(r, 4 * w, K) // 4
            if s == rank:  # the epilogue's stores; the push reads the same words back
                full[at] = linear[rows]
                assert torch.equal(full[at], linear[rows])
            else:  # the copy-out's stores of the pushed linear rows
                full[at] = linear[rows]
            writes[at] += 1
        pad = torch.arange(kw * Mp)
        pad = pad[swizzled_word_row(pad % (kw * 128)) + pad // (kw * 128) * 128 >= M]
        full[pad] = 0  # store_padding_words
        writes[pad] += 1
        assert torch.equal(full, want) and bool((writes == 1).all())
