"""Exact PyTorch reference of every distnorm op (docs/SEMANTICS.md); the kernels are tested against it.

Plain vectorized torch on whatever device the inputs live on. Every float32 step is a separate
torch op, so each is rounded exactly as the semantics say (no fused multiply-adds, no reordering).
The only freedoms the kernels have are the ones SEMANTICS.md grants: the reduction order of the
mean square, and the rsqrt approximation.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .formats import (
    E2M1_MAX, E4M3_MAX, PER_TOKEN_MIN_AMAX, NormQuantOutput, QuantSpec, amax_nan, check_hidden,
    div_f32, e2m1_codes, e2m1_values, e4m3_rn_satfinite, from_swizzled, make_quant_spec, pack_fp4,
    rcp, round_up_pow2_bits, scales_geometry, to_swizzled, ue8m0_code, ue8m0_inverse, ue8m0_value,
    unpack_fp4,
)

__all__ = ["NormQuantOutput", "rmsnorm_ref", "quantize_ref", "add_rmsnorm_ref", "allreduce_ref",
           "allreduce_add_rmsnorm_ref", "dequantize"]

ACT_DTYPES = (torch.bfloat16, torch.float16)
SpecLike = Union[QuantSpec, str, None]


def _spec(spec: SpecLike) -> Optional[QuantSpec]:
    return spec if spec is None or isinstance(spec, QuantSpec) else make_quant_spec(spec)


def _one_f32(t, name: str, device) -> Tensor:
    """A float32 one-element tensor argument, as a 0-dim tensor on `device`."""
    if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor of one element, got {t!r}")
    return t.reshape(()).to(device)


def _check_scale_args(spec: Optional[QuantSpec], scale, global_scale) -> None:
    if spec is None:
        return
    if spec.kind == "fp8" and scale is None:
        raise ValueError("quant='fp8' (static) needs scale: a float32 tensor of one element")
    if spec.kind == "nvfp4" and global_scale is None:
        raise ValueError("quant='nvfp4' needs global_scale: a float32 tensor of one element")


def rmsnorm_ref(h: Tensor, weight: Tensor, eps: float, gemma: bool = False) -> Tensor:
    """RMSNorm over the last dim, in float32.

    h: [M, H] (any float dtype, rows may be strided); weight: [H]. eps is used as float32(eps).
    Returns float32 y [M, H] = (float(h) * rsqrt(mean(float(h)^2) + eps)) * wf,
    wf = float(w) or, for gemma, 1 + float(w).
    """
    hf = h.float()
    ms = hf.square().mean(dim=-1, keepdim=True)
    r = torch.rsqrt(ms + eps)
    wf = weight.float()
    if gemma:
        wf = 1.0 + wf
    return (hf * r) * wf


def _blocks(y: Tensor, g: int) -> Tensor:
    M, H = y.shape
    return y.reshape(M, H // g, g)


def _layout(spec: QuantSpec, linear: Tensor) -> Tensor:
    return to_swizzled(linear) if spec.swizzled else linear


def quantize_ref(y: Tensor, spec: SpecLike, scale: Optional[Tensor] = None,
                 global_scale: Optional[Tensor] = None) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Quantize float32 y [M, H] per `spec` (a QuantSpec, or a quant name with default options).

    Returns (q, scales): q float8_e4m3fn [M, H] or, for nvfp4/mxfp4, uint8 [M, H/2] (element 2k in
    the low nibble); scales as formats.scales_geometry says (static fp8: the given `scale` itself).
    quant=None gives (None, None).
    """
    spec = _spec(spec)
    if spec is None:
        return None, None
    _check_scale_args(spec, scale, global_scale)
    if y.dim() != 2 or y.dtype != torch.float32:
        raise ValueError(f"y must be a float32 [M, H] tensor, got {y.dtype} {tuple(y.shape)}")
    M, H = y.shape
    if H % spec.hidden_multiple:
        raise ValueError(f"hidden size H={H} is not a multiple of the {spec.kind} block {spec.block}")
    kind = spec.kind
    if kind == "fp8":
        s = _one_f32(scale, "scale", y.device)
        return e4m3_rn_satfinite(y * rcp(s)), scale
    if kind in ("fp8_per_token", "fp8_per_group"):
        g = H if kind == "fp8_per_token" else spec.group_size
        yb = _blocks(y, g)
        # max(a, 1e-10) must keep NaN: clamp does, fmax would not
        s = div_f32(amax_nan(yb).clamp(min=PER_TOKEN_MIN_AMAX), E4M3_MAX)
        if spec.scale_ue8m0:
            s = round_up_pow2_bits(s)
        q = e4m3_rn_satfinite(yb * rcp(s).unsqueeze(-1)).reshape(M, H)
        shape, stride, dtype = scales_geometry(spec, M, H)
        out = torch.empty_strided(shape, stride, dtype=dtype, device=y.device)
        out.copy_(s.reshape(shape))
        return q, out
    yb = _blocks(y, spec.group_size)
    bmax = amax_nan(yb)
    if kind == "nvfp4":
        gs = _one_f32(global_scale, "global_scale", y.device)
        rcp6 = rcp(torch.tensor(E2M1_MAX, device=y.device))
        sf = e4m3_rn_satfinite(gs * (bmax * rcp6))
        sff = sf.float()
        o = torch.where(sff == 0, 0.0, rcp(sff * rcp(gs)))
        q = pack_fp4(e2m1_codes(yb * o.unsqueeze(-1)).reshape(M, H))
        return q, _layout(spec, sf)
    c = ue8m0_code(div_f32(bmax, E4M3_MAX if kind == "mxfp8" else E2M1_MAX))
    u = yb * ue8m0_inverse(c).unsqueeze(-1)
    if kind == "mxfp8":
        q = e4m3_rn_satfinite(u).reshape(M, H)
    else:
        q = pack_fp4(e2m1_codes(u).reshape(M, H))
    return q, _layout(spec, c)


def dequantize(q: Tensor, scales: Optional[Tensor], spec: SpecLike, *, M: Optional[int] = None,
               H: Optional[int] = None, scale: Optional[Tensor] = None,
               global_scale: Optional[Tensor] = None) -> Tensor:
    """float32 [M, H] values that (q, scales) encode, for every format and scale layout.

    M, H default to what q's shape implies. Static fp8 uses `scale` (default: `scales`, which is
    the scale tensor the op returned); nvfp4 needs `global_scale`.
    """
    spec = _spec(spec)
    if spec is None:
        raise ValueError("spec must name a quantization format, got None")
    M = q.shape[0] if M is None else M
    H = (q.shape[1] * (2 if spec.packed_fp4 else 1)) if H is None else H
    if spec.kind == "fp8":
        s = _one_f32(scale if scale is not None else scales, "scale", q.device)
        return q.float() * s
    if spec.kind == "fp8_per_token":
        return q.float() * scales.reshape(M, 1)
    g = spec.group_size
    K = H // g
    if spec.kind == "fp8_per_group":
        return (_blocks(q.float(), g) * scales.reshape(M, K, 1)).reshape(M, H)
    lin = from_swizzled(scales, M, K) if spec.swizzled else scales.reshape(M, K)
    vals = _blocks(e2m1_values(unpack_fp4(q)) if spec.packed_fp4 else q.float(), g)
    if spec.kind == "nvfp4":
        gs = _one_f32(global_scale, "global_scale", q.device)
        return ((vals * lin.float().unsqueeze(-1)) * rcp(gs)).reshape(M, H)
    return (vals * ue8m0_value(lin).unsqueeze(-1)).reshape(M, H)


def _check_rows(name: str, t: Tensor, dtype: Optional[torch.dtype], shape) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if dtype is None and t.dtype not in ACT_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype} (x's), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _norm_quant(acc: Tensor, dtype: torch.dtype, residual: Optional[Tensor], weight: Tensor,
                eps: float, spec: Optional[QuantSpec], scale, global_scale, gemma: bool,
                norm_out: bool, allreduce: Optional[Tensor]) -> NormQuantOutput:
    """Shared tail of every op: float32 sum acc [M, H] -> residual add, norm, quantization."""
    if residual is not None:
        h = (acc + residual.float()).to(dtype)  # one rounding of the full sum
    else:
        h = acc.to(dtype)
    y = rmsnorm_ref(h, weight, eps, gemma)
    q, scales = quantize_ref(y, spec, scale, global_scale)
    y_out = y.to(dtype) if (norm_out or spec is None) else None
    return NormQuantOutput(h if residual is not None else None, y_out, q, scales, allreduce)


def _prepare(x: Tensor, residual, weight, quant, scale, global_scale, group_size, sf_layout,
             scale_major, scale_ue8m0) -> Optional[QuantSpec]:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [M, H] tensor, got {getattr(x, 'shape', x)!r}")
    _check_rows("x", x, None, x.shape)
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    check_hidden(spec, x.shape[1])
    if residual is not None:
        _check_rows("residual", residual, x.dtype, x.shape)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight must be a [{x.shape[1]}] tensor, got {getattr(weight, 'shape', weight)!r}")
    _check_scale_args(spec, scale, global_scale)
    return spec


def add_rmsnorm_ref(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *,
                    quant: Optional[str] = None, scale: Optional[Tensor] = None,
                    global_scale: Optional[Tensor] = None, group_size: int = 128,
                    sf_layout: str = "swizzled", scale_major: str = "row", scale_ue8m0: bool = False,
                    gemma: bool = False, norm_out: bool = False) -> NormQuantOutput:
    """Single-GPU fused residual add + RMSNorm (+ quantization).

    x, residual: [M, H] bf16/fp16 (rows may be strided); weight [H]. Returns NormQuantOutput:
    residual = h = T(float(x) + float(residual)) [M, H] T (None without a residual, then h = x);
    y = T(y) when norm_out or quant is None; q, scales per quantize_ref.
    """
    spec = _prepare(x, residual, weight, quant, scale, global_scale, group_size, sf_layout,
                    scale_major, scale_ue8m0)
    return _norm_quant(x.float(), x.dtype, residual, weight, eps, spec, scale, global_scale,
                       gemma, norm_out, None)


def _ordered_sum(xs: Sequence[Tensor]) -> Tensor:
    """float32 sum in rank order: acc = x0; acc = acc + x1; ... (the order every rank uses)."""
    if len(xs) == 0:
        raise ValueError("xs must hold at least one tensor (one per rank)")
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor) or x.shape != xs[0].shape or x.dtype != xs[0].dtype:
            raise ValueError(f"xs[{i}] must be a tensor of xs[0]'s shape and dtype")
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc


def allreduce_ref(xs: Sequence[Tensor]) -> Tensor:
    """Plain all-reduce of the ranks' inputs xs[r] ([M, H] T): T(ordered float32 sum), one rounding."""
    return _ordered_sum(xs).to(xs[0].dtype)


def allreduce_add_rmsnorm_ref(xs: Sequence[Tensor], residual: Optional[Tensor], weight: Tensor,
                              eps: float = 1e-6, *, quant: Optional[str] = None,
                              scale: Optional[Tensor] = None, global_scale: Optional[Tensor] = None,
                              group_size: int = 128, sf_layout: str = "swizzled",
                              scale_major: str = "row", scale_ue8m0: bool = False,
                              gemma: bool = False, norm_out: bool = False,
                              allreduce_out: bool = False) -> NormQuantOutput:
    """All-reduce (ordered float32 sum of xs, one [M, H] T tensor per rank) + residual add + RMSNorm
    (+ quantization). Same outputs as add_rmsnorm_ref with x replaced by the float32 sum acc:
    residual = T(acc + float(residual)) (None without a residual, then h = T(acc));
    allreduce = T(acc) when allreduce_out.
    """
    if len(xs) == 0:
        raise ValueError("xs must hold at least one tensor (one per rank)")
    spec = _prepare(xs[0], residual, weight, quant, scale, global_scale, group_size, sf_layout,
                    scale_major, scale_ue8m0)
    acc = _ordered_sum(xs)
    dtype = xs[0].dtype
    return _norm_quant(acc, dtype, residual, weight, eps, spec, scale, global_scale, gemma,
                       norm_out, acc.to(dtype) if allreduce_out else None)
