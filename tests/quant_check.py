"""Comparison of kernel outputs with the reference, shared by the single-GPU and all-reduce tests.

Bounds (docs/SEMANTICS.md allows kernels to differ only by float32 reduction order and rsqrt rounding):
- residual / all-reduce output: bitwise equal (same single rounding of the same float32 sum).
- y = T(y): within 1 ulp of T (y differs from the reference by a few float32 ulps before rounding,
  which can move the bf16/fp16 rounding by at most one step).
- quantized codes: equal for >= 99.9% of elements; the others one code step apart (an input a few
  float32 ulps from a rounding midpoint can round the other way). Compared in sign-magnitude order so
  that "one step" holds across code boundaries.
- scales: equal for >= 99.9% of blocks; the others one step apart (e4m3 / UE8M0 code +-1, float32
  within FLOAT_SCALE_ULPS = 8 ulps of the reference's: distnorm/demo/check.py says why). Elements
  of blocks whose scale differs are checked after dequantization against one step of the coarser
  scale.
"""
from __future__ import annotations

import torch

from distnorm import formats
from distnorm.demo.check import MATCH_FRACTION, scales_problem, y_problem  # the bounds, written once
from distnorm.reference import dequantize


def quant_kwargs(quant, opts: dict, device="cpu") -> dict:
    """The op keywords of a format variant: quant, its options, and the scalar it needs (static
    FP8 scale 0.05, NVFP4 global scale 448 * 6 / 12)."""
    kw = dict(quant=quant, **opts)
    if quant == "fp8":
        kw["scale"] = torch.tensor([0.05], device=device)
    if quant == "nvfp4":
        kw["global_scale"] = torch.tensor([448 * 6 / 12.0], device=device)
    return kw


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or 0xFF bytes (fp8 NaN, fp4 -0/-6 codes) so unwritten elements are caught."""
    if t.is_floating_point() and t.element_size() > 1:
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0xFF)
    return t


def _ordinal(codes: torch.Tensor, bits: int) -> torch.Tensor:
    c = codes.to(torch.int32)
    sign = (c >> (bits - 1)) & 1
    mag = c & ((1 << (bits - 1)) - 1)
    return torch.where(sign == 1, -mag, mag)


def _codes(q: torch.Tensor, spec) -> tuple[torch.Tensor, int]:
    if spec.packed_fp4:
        return formats.unpack_fp4(q.view(torch.uint8)), 4
    return q.view(torch.uint8), 8


def assert_y_close(y, y_ref):
    problem = y_problem(y, y_ref)
    assert not problem, problem


def assert_scales_close(s, s_ref, spec):
    problem = scales_problem(s, s_ref, spec)
    assert not problem, problem


def assert_quant_close(q, scales, ref, spec, M, H, scale=None, global_scale=None):
    """q/scales from a kernel against a NormQuantOutput `ref` from the reference."""
    if spec.kind != "fp8":
        assert_scales_close(scales, ref.scales, spec)
    cq, bits = _codes(q, spec)
    cr, _ = _codes(ref.q, spec)
    eq = cq == cr
    frac = eq.float().mean().item() if eq.numel() else 1.0
    assert frac >= MATCH_FRACTION, f"only {frac:.5f} of quantized elements equal the reference"
    near = (_ordinal(cq, bits) - _ordinal(cr, bits)).abs() <= 1
    if not near.all():
        # elements whose block scale legitimately differs: compare dequantized values
        dq = dequantize(q, scales, spec, M=M, H=H, scale=scale, global_scale=global_scale)
        dr = dequantize(ref.q, ref.scales, spec, M=M, H=H, scale=scale, global_scale=global_scale)
        step = (dr.abs() * 0.25 if spec.packed_fp4 else dr.abs() * 0.125)
        blk_max = dr.abs().amax(dim=-1, keepdim=True)
        tol = torch.maximum(step, blk_max * (0.5 / 6 if spec.packed_fp4 else 2.0 ** -9))
        far = (~near) & ((dq - dr).abs() > tol * 1.01)
        assert not far.any(), f"{far.sum().item()} quantized elements differ by more than one step"
