"""One op's outputs against the reference, with the bounds of the library's tests (docs/SEMANTICS.md
lets kernels differ only in the float32 reduction order of the mean square and the rsqrt rounding):

- residual: bitwise equal (the same single rounding of the same float32 sum);
- y = T(y): within 1 ulp of T;
- quantized codes: >= 99.9% equal;
- scales: float32 per-token / per-group within FLOAT_SCALE_ULPS (8) ulps; otherwise >= 99.9% equal
  and the rest one step apart (e4m3 / UE8M0 code +-1, or a factor 2 for UE8M0-rounded float32 scales).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from distnorm.formats import NormQuantOutput, QuantSpec, unpack_fp4

MATCH_FRACTION = 0.999
# A float32 scale is amax|y| / 448 and y = (h * r) * w with r = rsqrt(ms + eps): r may differ by the
# rsqrt approximation (<= 2 ulps) plus half of ms's reduction-order difference (a few ulps of ms),
# and the two products and the division each round on their own, so a kernel's scale can be ~5-6
# ulps (relative, 2^-23 of the reference's scale) from the reference's. 4 was once the bound: the
# 2-rank all-reduce grid at M = 8192, H = 4096 (seed 84) had 2 of 262144 per-group scales at 5 ulps.
FLOAT_SCALE_ULPS = 8


@dataclass(frozen=True)
class CheckResult:
    """ok: every bound holds; match: fraction of q codes (or of y without quantization) bitwise
    equal to the reference (None for M = 0); problem: the first bound that failed ("" when ok)."""

    ok: bool
    match: Optional[float]
    problem: str = ""


def _equal_fraction(eq: Tensor) -> Optional[float]:
    """Fraction of True in eq; None when eq is empty (M = 0: only the shapes can be checked)."""
    return eq.float().mean().item() if eq.numel() else None


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def _codes(q: Tensor, spec: QuantSpec) -> Tensor:
    return unpack_fp4(q.view(torch.uint8)) if spec.packed_fp4 else q.view(torch.uint8)


def y_problem(y: Tensor, y_ref: Tensor) -> str:
    """Why y = T(y) is not within 1 ulp of T of the reference ("" when it is)."""
    if torch.isnan(y).any():
        return "y has NaN (unwritten or wrong)"
    diff = (y.float() - y_ref.float()).abs()
    ulp = torch.finfo(y.dtype).eps * y_ref.float().abs().clamp_min(torch.finfo(y.dtype).tiny)
    bad = int((diff > ulp * 1.0001 + 1e-30).sum())
    return (f"y differs by more than 1 ulp at {bad} elements, max diff {diff.max().item()}"
            if bad else "")


def scales_problem(s: Tensor, s_ref: Tensor, spec: QuantSpec) -> str:
    """Why the scales break their bound (module docstring; "" when they hold)."""
    if spec.float_scales:
        a, b = s.float(), s_ref.float()
        if torch.isnan(a).any():
            return "scales have NaN (unwritten?)"
        if not spec.scale_ue8m0:  # amax inherits y's few-ulp freedom: no exact-match bound
            ulps = (a - b).abs() / (torch.finfo(torch.float32).eps * b.abs())
            far = int((ulps > FLOAT_SCALE_ULPS).sum())
            if not far:
                return ""
            worst = int(ulps.flatten().nan_to_num(0).argmax())
            return (f"{far} float32 scales differ by more than {FLOAT_SCALE_ULPS} ulps (the most: "
                    f"{ulps.max().item():.1f} ulps,"
                    f" {a.flatten()[worst].item()!r} against {b.flatten()[worst].item()!r})")
        eq = a == b
        near = eq | (a == 2 * b) | (2 * a == b)
    else:
        a, b = s.view(torch.uint8).to(torch.int32), s_ref.view(torch.uint8).to(torch.int32)
        eq = a == b
        near = (a - b).abs() <= 1
    if not near.all():
        return f"{int((~near).sum())} scales differ by more than one step"
    frac = _equal_fraction(eq)
    return f"only {frac:.5f} of scales equal" if frac is not None and frac < MATCH_FRACTION else ""


def _shape_problem(out: NormQuantOutput, ref: NormQuantOutput) -> str:
    for field in NormQuantOutput._fields:
        a, b = getattr(out, field), getattr(ref, field)
        if (a is None) != (b is None):
            return f"{field}: {'missing' if a is None else 'unexpected'}"
        if a is not None and (tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype):
            return f"{field}: {a.dtype} {tuple(a.shape)}, reference {b.dtype} {tuple(b.shape)}"
    return ""


def compare(out: NormQuantOutput, ref: NormQuantOutput, spec: Optional[QuantSpec]) -> CheckResult:
    """Judge `out` (an op's result, on any device) against `ref` (the reference's)."""
    problem = _shape_problem(out, ref)
    if problem:
        return CheckResult(False, 0.0, problem)
    if out.residual is not None and not torch.equal(_bits(out.residual), _bits(ref.residual)):
        return CheckResult(False, 0.0, "residual differs from the reference (must be bitwise)")
    if spec is None:
        match = _equal_fraction(_bits(out.y) == _bits(ref.y))
        problem = y_problem(out.y, ref.y)
    else:
        match = _equal_fraction(_codes(out.q, spec) == _codes(ref.q, spec))
        if match is not None and match < MATCH_FRACTION:
            problem = f"only {match:.5f} of quantized codes equal the reference"
        elif spec.kind != "fp8":  # static fp8 returns the caller's scale tensor
            problem = scales_problem(out.scales, ref.scales, spec)
    return CheckResult(not problem, match, problem)
