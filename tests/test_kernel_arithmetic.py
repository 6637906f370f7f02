"""Integer arithmetic the kernels run, checked on the CPU against the reference (the GPU tests
check the kernels themselves):
- e2m1 rounding by bit arithmetic (NormQuantCore._e2m1_code), emulated in torch, against
  formats.e2m1_codes: every float32 within 4096 ulps of each rounding threshold and grid value,
  the specials, and a million random patterns (run once over all 2^32 patterns when it was written:
  no mismatch);
- the swizzled-scale offset (formats.swizzled_offset, the very function the kernels call) against
  formats.to_swizzled."""
import pytest
import torch

from distnorm.formats import E2M1_GRID, e2m1_codes, swizzled_offset, to_swizzled

THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def kernel_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """What _e2m1_code computes, step by step (int64 so shifts are plain)."""
    a = torch.nan_to_num(v.abs(), nan=0.0).clamp(0.0, 6.0)  # e2m1_clamp: max.f32(NaN, 0) = 0
    b = a.view(torch.int32).to(torch.int64)
    code = ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252
    low = (a * 2.0 + 8388608.0).view(torch.int32).to(torch.int64) - 0x4B000000
    code = torch.where(b < 0x3F800000, low, code)
    return code | ((v.view(torch.int32).to(torch.int64) >> 28) & 0x8)


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
