"""User-facing single-GPU op: argument checks, output allocation, dispatch.

`add_rmsnorm` is registered as the `torch.library` custom op `distnorm::add_rmsnorm_out` (outputs
passed in and mutated), with a fake implementation for tracing, the CuTe kernel for CUDA tensors and
the reference for CPU tensors. In eager mode the wrapper calls the implementation directly: the
custom-op dispatcher costs several microseconds of host time that a decode step cannot spare.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .formats import (NormQuantOutput, QuantSpec, check_hidden, empty_scales, make_quant_spec,
                      q_dtype, q_shape, scales_geometry)

ACT_DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- argument checks (shared with the all-reduce ops) -------------------------------------------

def check_rows(name: str, t, like: Optional[Tensor], shape, dtype=None) -> None:
    """ValueError/TypeError naming `name` unless t is a [M, H] tensor on like's device, last dim
    contiguous, rows 16-byte aligned (what the kernels' 128-bit accesses need)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    want = dtype if dtype is not None else (like.dtype if like is not None else None)
    if want is not None and t.dtype != want:
        raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if want is None and t.dtype not in ACT_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {t.device}")
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_aligned(name: str, t: Tensor, align: int = 16) -> None:
    """At dispatch (not traced): rows must start at `align`-byte boundaries for 128-bit accesses."""
    if t.shape[0] > 1 and (t.stride(0) * t.element_size()) % align or t.data_ptr() % align:
        raise ValueError(f"{name} rows must start at {align}-byte aligned addresses "
                         f"(row stride {t.stride(0)} elements, data_ptr {t.data_ptr():#x})")


def check_scalar_f32(name: str, t, device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a float32 tensor of one element, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(f"{name} must be a float32 tensor of one element, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_inputs(x, residual, weight, spec: Optional[QuantSpec], scale, global_scale, eps) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be a 2-D [M, H] tensor, got shape {tuple(x.shape)}")
    check_rows("x", x, None, x.shape)
    check_hidden(spec, x.shape[1])
    if residual is not None:
        check_rows("residual", residual, x, x.shape)
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if tuple(weight.shape) != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be a [{x.shape[1]}] {x.dtype} tensor on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if x.is_cuda and weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if not isinstance(eps, (float, int)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    kind = spec.kind if spec is not None else None
    if kind == "fp8":
        if scale is None:
            raise ValueError("scale is required for quant='fp8' (static per-tensor scale, float32 [1])")
        check_scalar_f32("scale", scale, x.device)
    if kind == "nvfp4":
        if global_scale is None:
            raise ValueError("global_scale is required for quant='nvfp4' (float32 [1], usually 448*6/amax)")
        check_scalar_f32("global_scale", global_scale, x.device)


def allocate_outputs(x: Tensor, spec: Optional[QuantSpec], has_residual: bool, want_y: bool,
                     residual_out, y_out, q_out, scales_out):
    """Allocate the outputs the caller did not pass; check the ones they did."""
    M, H = x.shape
    if has_residual:
        if residual_out is None:
            residual_out = torch.empty((M, H), dtype=x.dtype, device=x.device)
        elif residual_out.shape != x.shape or residual_out.dtype != x.dtype:
            check_rows("residual_out", residual_out, x, x.shape)
    if want_y:
        if y_out is None:
            y_out = torch.empty((M, H), dtype=x.dtype, device=x.device)
        elif y_out.shape != x.shape or y_out.dtype != x.dtype:
            check_rows("y_out", y_out, x, x.shape)
    if spec is not None:
        if q_out is None:
            q_out = torch.empty(q_shape(spec, M, H), dtype=q_dtype(spec), device=x.device)
        elif q_out.shape != q_shape(spec, M, H) or q_out.dtype != q_dtype(spec):
            check_rows("q_out", q_out, x, q_shape(spec, M, H), dtype=q_dtype(spec))
        if spec.kind != "fp8":
            geo = scales_geometry(spec, M, H)
            if scales_out is None:
                scales_out = empty_scales(spec, M, H, x.device)
            elif (scales_out.shape, scales_out.stride(), scales_out.dtype) != geo or \
                    scales_out.device != x.device:
                raise ValueError(f"scales_out must have shape {geo[0]}, strides {geo[1]}, dtype {geo[2]} "
                                 f"on {x.device}; got {tuple(scales_out.shape)}, {scales_out.stride()}, "
                                 f"{scales_out.dtype} on {scales_out.device}")
    return residual_out, y_out, q_out, scales_out


# ---- kernel dispatch ----------------------------------------------------------------------------

def quant_params(spec: Optional[QuantSpec]):
    from .kernels.norm_quant import QuantParams

    if spec is None:
        return QuantParams()
    return QuantParams(spec.kind, spec.group_size, spec.sf_layout == "swizzled",
                       spec.scale_major == "col", spec.scale_ue8m0)


def kernel_views(spec: Optional[QuantSpec], q: Optional[Tensor], scales: Optional[Tensor]):
    """The int32 / uint8 views the kernels take (see kernels/compile.py)."""
    if spec is None:
        return None, None
    qv = q.view(torch.int32)  # fp8 [M, H] or packed fp4 [M, H/2]: rows hold whole int32 words
    sv = None
    if scales is not None:
        if spec.block_scaled:
            sv = scales.view(torch.uint8)
            if spec.sf_layout == "swizzled":
                sv = sv.view(-1)
        else:
            sv = scales
    return qv, sv


def cluster_for(H: int, M: int) -> int:
    """Thread-block cluster size (CTAs sharing one row through distributed shared memory).

    Few rows (M <= 64): one CTA per 4096 elements of a row, up to the portable 8, so a decode step's
    row is spread over several SMs and each thread's serial chain stays at ~4 vectors. Many rows:
    no cluster, except H = 32768, where one CTA per row would need 1024 threads (capped at 64
    registers, which spills) or 8 vectors per thread; 2 CTAs of 512 threads hold it in registers.
    Chosen from benchmarks/results/single_gpu_h200.md (M in 1..65536, H200).
    """
    if M <= 64:
        return max(1, min(8, H // 4096))
    return 2 if H >= 32768 else 1


def run_fused_norm_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                          y_out, q_out, scales_out) -> None:
    from .kernels.compile import compiled_fused_norm

    M, H = x.shape
    if M == 0:
        return
    qparams = cached_spec(*spec_to_user_args(spec))[1]
    kernel = compiled_fused_norm(_DTYPE_NAMES[x.dtype], H, qparams, residual is not None,
                                 gemma, y_out is not None, cluster_for(H, M))
    for name, t in (("x", x), ("residual", residual), ("residual_out", residual_out), ("y_out", y_out)):
        if t is not None and (t.data_ptr() | (t.stride(0) * 2 if M > 1 else 0)) % 16:
            check_aligned(name, t)
    qv, sv = kernel_views(spec, q_out, scales_out)
    kernel(x, residual, residual_out, weight, y_out, qv, sv, scale, global_scale, float(eps))


def _run_reference(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                   q_out, scales_out) -> None:
    from .reference import add_rmsnorm_ref

    ref = add_rmsnorm_ref(x, residual, weight, eps, quant=spec, scale=scale,
                          global_scale=global_scale, gemma=gemma, norm_out=y_out is not None)
    for out, val in ((residual_out, ref.residual), (y_out, ref.y), (q_out, ref.q)):
        if out is not None:
            out.copy_(val)
    if scales_out is not None and spec is not None and spec.kind != "fp8":
        scales_out.copy_(ref.scales)


def _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
          scales_out) -> None:
    if x.is_cuda:
        run_fused_norm_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma,
                              residual_out, y_out, q_out, scales_out)
    else:
        _run_reference(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                       y_out, q_out, scales_out)


# ---- torch.library registration -----------------------------------------------------------------
# The quant spec travels through the op schema as strings/ints (schemas take no dataclasses).

def spec_to_args(spec: Optional[QuantSpec]):
    if spec is None:
        return "none", 0, "linear", "row", False
    return spec.kind, spec.group_size, spec.sf_layout, spec.scale_major, spec.scale_ue8m0


def spec_to_user_args(spec: Optional[QuantSpec]):
    """The add_rmsnorm keyword values that produce `spec` (cached_spec's key)."""
    if spec is None:
        return None, 128, "swizzled", "row", False
    return spec.kind, spec.group_size or 128, spec.sf_layout, spec.scale_major, spec.scale_ue8m0


def spec_from_args(kind: str, group_size: int, sf_layout: str, scale_major: str, ue8m0: bool):
    if kind == "none":
        return None
    return QuantSpec(kind, group_size, sf_layout, scale_major, ue8m0)


@torch.library.custom_op("distnorm::add_rmsnorm_out",
                         mutates_args=("residual_out", "y_out", "q_out", "scales_out"))
def _add_rmsnorm_out(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                     kind: str, group_size: int, sf_layout: str, scale_major: str, ue8m0: bool,
                     scale: Optional[Tensor], global_scale: Optional[Tensor], gemma: bool,
                     residual_out: Optional[Tensor], y_out: Optional[Tensor], q_out: Optional[Tensor],
                     scales_out: Optional[Tensor]) -> None:
    spec = spec_from_args(kind, group_size, sf_layout, scale_major, ue8m0)
    _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
          scales_out)


@_add_rmsnorm_out.register_fake
def _(x, residual, weight, eps, kind, group_size, sf_layout, scale_major, ue8m0, scale,
      global_scale, gemma, residual_out, y_out, q_out, scales_out) -> None:
    return None


_SPECS: dict = {}


def cached_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0):
    """make_quant_spec, memoized: validating and hashing dataclasses costs microseconds per call."""
    key = (quant, group_size, sf_layout, scale_major, scale_ue8m0)
    hit = _SPECS.get(key)
    if hit is None:
        spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                               scale_major=scale_major, scale_ue8m0=scale_ue8m0)
        hit = _SPECS[key] = (spec, quant_params(spec))
    return hit


def inputs_look_valid(x, residual, weight, spec, eps) -> bool:
    """Cheap checks of the common case; when False, check_inputs says exactly what is wrong."""
    if type(eps) not in (float, int) or not eps >= 0:
        return False
    if type(x) is not Tensor or x.dim() != 2 or x.dtype not in ACT_DTYPES:
        return False
    H = x.shape[1]
    if H % (8 if spec is None else spec.hidden_multiple) or not 256 <= H <= 32768:
        return False
    if type(weight) is not Tensor or weight.shape != (H,) or weight.dtype != x.dtype:
        return False
    dev = x.get_device()
    if weight.get_device() != dev:
        return False
    if residual is not None and (type(residual) is not Tensor or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.get_device() != dev):
        return False
    return True


def scalar_looks_valid(t, x: Tensor) -> bool:
    """Cheap check of a scale / global_scale argument: a float32 one-element tensor on x's device."""
    return (type(t) is Tensor and t.dtype == torch.float32 and t.numel() == 1
            and t.get_device() == x.get_device())


def add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *,
                quant: Optional[str] = None, scale: Optional[Tensor] = None,
                global_scale: Optional[Tensor] = None, group_size: int = 128,
                sf_layout: str = "swizzled", scale_major: str = "row", scale_ue8m0: bool = False,
                gemma: bool = False, norm_out: bool = False, residual_out: Optional[Tensor] = None,
                y_out: Optional[Tensor] = None, q_out: Optional[Tensor] = None,
                scales_out: Optional[Tensor] = None) -> NormQuantOutput:
    """Fused [residual add] + RMSNorm [+ quantization] on one GPU (or the reference on CPU).

    x, residual: [M, H] bf16/fp16, rows may be strided (last dim contiguous, 16-byte aligned rows);
    weight: [H] of x's dtype. quant: None | "fp8" | "fp8_per_token" | "fp8_per_group" | "nvfp4" |
    "mxfp8" | "mxfp4" (docs/SEMANTICS.md); fp8 needs `scale`, nvfp4 `global_scale` (float32 [1]).
    Returns NormQuantOutput(residual=h [M, H] when a residual is given, y=T(y) when norm_out or no
    quant, q, scales). Outputs passed in are written in place (residual_out may be `residual`).
    """
    spec, _ = cached_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0)
    kind = None if spec is None else spec.kind
    if (not inputs_look_valid(x, residual, weight, spec, eps)
            or (kind == "fp8" and not scalar_looks_valid(scale, x))
            or (kind == "nvfp4" and not scalar_looks_valid(global_scale, x))):
        check_inputs(x, residual, weight, spec, scale, global_scale, eps)  # raises with the reason
    want_y = norm_out or spec is None or y_out is not None
    residual_out, y_out, q_out, scales_out = allocate_outputs(
        x, spec, residual is not None, want_y, residual_out, y_out, q_out, scales_out)
    if torch.compiler.is_compiling():
        _add_rmsnorm_out(x, residual, weight, float(eps), *spec_to_args(spec), scale, global_scale,
                         gemma, residual_out, y_out, q_out, scales_out)
    else:
        _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
              q_out, scales_out)
    return NormQuantOutput(residual_out, y_out, q_out, scale if kind == "fp8" else scales_out, None)
