"""The ops' entry, shared by every op: argument checks with the library's own messages, output
allocation, and the tensor views the kernels take.

The eager ops first run the cheap `inputs_look_valid` / `scalar_looks_valid`; only when they say no
does `check_inputs` run, to raise with the exact reason. (The single-GPU op on CUDA tensors leaves
the tensor checks to the compiled kernel's entry and runs these only when that fails:
ops._launch_kernel_checked.) Values inside tensors are not read (that
would synchronize with the GPU and break CUDA graphs) unless value checks are on: DISTNORM_CHECK=1
in the environment, or `distnorm.set_value_checks(True)`; then scale / global_scale must be finite
and > 0 and x, residual and weight finite, or the call raises ValueError.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Optional

import torch
from torch import Tensor

from .formats import (MAX_HIDDEN, MIN_HIDDEN, QuantSpec, check_hidden, empty_scales,
                      hidden_multiple, q_dtype, q_shape, scales_geometry)

ACT_DTYPES = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DENSE = torch.contiguous_format


_value_checks = os.environ.get("DISTNORM_CHECK", "0") == "1"


def set_value_checks(enabled: bool) -> bool:
    """Turn the value checks (module docstring) on or off for this process; returns the previous
    setting. Off by default (DISTNORM_CHECK=1 turns them on at import)."""
    global _value_checks
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, _value_checks = _value_checks, enabled
    return previous


def checked_mode() -> bool:
    """Checked mode (DISTNORM_CHECK=1 or set_value_checks(True)): value checks on, and every
    all-reduce call waits for its kernels and raises its own failure."""
    return _value_checks


def check_values(x: Tensor, residual, weight: Tensor, spec: Optional[QuantSpec], scale,
                 global_scale) -> None:
    """With value checks on (and not during CUDA-graph capture): ValueError unless the format's
    scale / global_scale is finite and > 0 and x, residual, weight are finite."""
    if not _value_checks or torch.compiler.is_compiling() or (
            x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    scalar = format_scalar(spec)
    for name, t in (("scale", scale), ("global_scale", global_scale)):
        if scalar == name:
            v = float(t.reshape(()).item())
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0 for quant={spec.kind!r}, got {v} "
                                 "(value checks are on: DISTNORM_CHECK=1)")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{name} holds {bad} non-finite value(s) (value checks are on: "
                             "DISTNORM_CHECK=1)")


def check_flags(**flags) -> None:
    """Each keyword must be a bool: a string such as "False" is truthy and would silently select
    the other kernel variant (gemma's (1 + w), or an output the caller did not ask for)."""
    for name, value in flags.items():
        if type(value) is not bool:
            raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def check_count(name: str, value, minimum: int = 0) -> None:
    """A row count or size: an integer (not a bool; numpy's and torch.compile's symbolic ints
    count) >= minimum, else TypeError / ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_eps(eps) -> None:
    """eps must be a finite real number >= 0 (an int or float; not a bool)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


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
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
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
    if x.dim() != 2:  # the ops flatten [..., H] first (rows.py)
        raise ValueError(f"x must be a [..., H] tensor, got shape {tuple(x.shape)}")
    check_rows("x", x, None, x.shape)
    check_hidden(spec, x.shape[1])
    if residual is not None:
        check_rows("residual", residual, x, x.shape)
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if tuple(weight.shape) != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be a [{x.shape[1]}] {x.dtype} tensor on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if weight.stride(0) != 1 and x.shape[1] > 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride(0)}")
    check_eps(eps)
    scalar = format_scalar(spec)
    if scalar == "scale":
        if scale is None:
            raise ValueError(f"scale is required for quant={spec.kind!r} (static per-tensor scale, "
                             "float32 [1])")
        check_scalar_f32("scale", scale, x.device)
    if scalar == "global_scale":
        if global_scale is None:
            raise ValueError(f"global_scale is required for quant={spec.kind!r} (float32 [1], "
                             "usually 448*6/amax)")
        check_scalar_f32("global_scale", global_scale, x.device)


def check_op_inputs(x, residual, weight, spec: Optional[QuantSpec], scale, global_scale,
                    eps) -> None:
    """Every op's input check, on every device: the cheap look first, check_inputs (which raises)
    only when it fails; the value checks when they are on. (Row alignment needs data pointers, which
    torch.compile cannot trace: the ops check it at dispatch, check_rows_aligned.)"""
    scalar = format_scalar(spec)
    if (not inputs_look_valid(x, residual, weight, spec, eps)
            or (scalar == "scale" and not scalar_looks_valid(scale, x))
            or (scalar == "global_scale" and not scalar_looks_valid(global_scale, x))):
        check_inputs(x, residual, weight, spec, scale, global_scale, eps)
    if _value_checks:
        check_values(x, residual, weight, spec, scale, global_scale)


def check_rows_aligned(tensors, M: int) -> None:
    """At dispatch, on every device: every (name, [M, K] tensor or None[, alignment]) has rows and a
    data pointer aligned to 16 bytes (what the kernels' 128-bit accesses need) or to its own
    alignment (q: q_alignment). Checked on the CPU too, so both paths accept the same inputs."""
    for name, t, *align in tensors:
        a = align[0] if align else 16
        if t is not None and (t.data_ptr() | (t.stride()[0] * t.element_size() if M > 1 else 0)) % a:
            check_aligned(name, t, a)


def check_scales_aligned(scales_out: Optional[Tensor], spec: Optional[QuantSpec]) -> None:
    """At dispatch, on every device: a given 128x4-swizzled scales output starts 16-byte aligned
    (its padding rows are zeroed in 16-byte units, NOTE [padding words] in kernels/allreduce.py; its
    rows need no more, a tile being a multiple of 512 bytes). Other layouts' scales are stored one
    element at a time (float32 ones aligned by their dtype)."""
    if scales_out is not None and spec is not None and spec.swizzled and scales_out.data_ptr() % 16:
        raise ValueError(f"scales_out must start at a 16-byte aligned address (the swizzled "
                         f"layout's padding rows are stored in 16-byte units); got data_ptr() % 16 "
                         f"= {scales_out.data_ptr() % 16}: pass a tensor of its own or a view at a "
                         f"multiple of 16 bytes")


def q_alignment(spec: Optional[QuantSpec]) -> int:
    """Bytes a q row (and q's data pointer) must be aligned to: the kernels store q in 32-bit words,
    FP8 codes two words (8 bytes) at a time (no quantization: no q, any value)."""
    return 4 if spec is None or spec.packed_fp4 else 8


def _check_given(name: str, t, x: Tensor, shape, dtype) -> None:
    """An output the caller passed: shape, dtype, device, last dim contiguous, aligned rows.
    (CUDA devices compared as get_device() ints, not .device objects: this runs on every eager
    call; -1 covers every non-CUDA device, so those compare the objects.)"""
    if type(t) is not Tensor or t.dtype != dtype or t.shape != shape:
        return check_rows(name, t, x, shape, dtype)
    dev = t.get_device()
    if (dev != x.get_device() or (dev < 0 and t.device != x.device)
            or (t.stride()[-1] != 1 and shape[-1] > 1)):
        check_rows(name, t, x, shape, dtype)


def _byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes t's elements occupy (empty for no elements)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return start, start + reach * t.element_size()


def _rows_collide(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one storage share a byte. Rows of one byte stride that sit side by
    side (the column halves of one [M, 2H] buffer) do not; any other meeting of spans counts."""
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a0 == a1 or b0 == b1 or a1 <= b0 or b1 <= a0:
        return False
    if a.dim() != 2 or b.dim() != 2 or a.stride(1) != 1 or b.stride(1) != 1:
        return True
    stride = a.stride(0) * a.element_size()
    ka, kb = a.shape[1] * a.element_size(), b.shape[1] * b.element_size()
    if stride != b.stride(0) * b.element_size() or ka + kb > stride:
        return True
    d = (b0 - a0) % stride  # b's row start within a's row pitch
    return d < ka or d + kb > stride


def _over_own_rows(out: Tensor, t: Tensor) -> bool:
    """Whether out's row i lies inside t's row i from its start (y_out=x, residual_out=residual,
    an FP8 q written over x's rows): the in-place form, which the kernels run one CTA per row
    (ops._writes_where_it_reads), so each row is read before it is written."""
    if out.dim() != 2 or t.dim() != 2 or out.data_ptr() != t.data_ptr():
        return False
    if out.shape[0] != t.shape[0] or out.stride(1) != 1 or t.stride(1) != 1:
        return False
    pitch = out.stride(0) * out.element_size()
    return ((out.shape[0] <= 1 or pitch == t.stride(0) * t.element_size())
            and out.shape[1] * out.element_size() <= t.shape[1] * t.element_size())


def check_outputs_apart(inputs: dict, outputs: dict) -> None:
    """ValueError naming both unless every given output is apart from the inputs and the other
    outputs, or lies over an input's own rows from their start (_over_own_rows: vLLM's in-place
    form residual_out=residual, y_out=x). Any other overlap is a race between rows on the GPU.
    Checked on the Python-checked paths (the CPU, DISTNORM_CHECK=1); the eager CUDA path leaves it
    out for host time (~1 us a call)."""
    if torch.compiler.is_compiling():
        return  # fake tensors: no addresses
    given = [(n, t) for n, t in outputs.items() if t is not None]
    if not given:
        return
    sources = [(n, t, True) for n, t in inputs.items() if t is not None]
    for i, (name, out) in enumerate(given):
        storage = out.untyped_storage().data_ptr()
        for other, t, is_input in sources + [(n, t, False) for n, t in given[:i]]:
            if t.untyped_storage().data_ptr() != storage:
                continue
            if is_input and _over_own_rows(out, t):
                continue
            if _rows_collide(out, t):
                raise ValueError(f"{name} overlaps {other}: an output must be apart from the inputs "
                                 f"and the other outputs, or be an input's own rows written in "
                                 f"place (residual_out=residual, y_out=x)")


def allocate_outputs(x: Tensor, spec: Optional[QuantSpec], has_residual: bool, want_y: bool,
                     residual_out, y_out, q_out, scales_out, check_given: bool = True,
                     scale_rows: int = -1):
    """Allocate the outputs the caller did not pass; check the ones they did (check_given=False:
    left to the compiled kernel's entry, ops._launch_kernel_checked; a scales output's exact
    strides and alignment, which the entry cannot check, are checked either way). Allocated with
    empty_like, the cheapest allocation call (host time: torch.empty costs about twice as much). scale_rows: the rows of
    the scales output's layout when not x's (the sequence-parallel kernel that writes the gathered
    scales of all M rows)."""
    M, H = x.shape
    if has_residual:
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=_DENSE)
        elif check_given:
            _check_given("residual_out", residual_out, x, x.shape, x.dtype)
    if want_y:
        if y_out is None:
            y_out = torch.empty_like(x, memory_format=_DENSE)
        elif check_given:
            _check_given("y_out", y_out, x, x.shape, x.dtype)
    if spec is not None:
        if q_out is None:
            shape, dtype = q_shape(spec, M, H), q_dtype(spec)
            q_out = (torch.empty_like(x, dtype=dtype, memory_format=_DENSE) if shape[1] == H
                     else x.new_empty(shape, dtype=dtype))
        elif check_given:
            _check_given("q_out", q_out, x, q_shape(spec, M, H), q_dtype(spec))
        S = M if scale_rows < 0 else scale_rows
        geo = scales_geometry(spec, S, H)
        if geo is not None:
            if scales_out is None:
                scales_out = empty_scales(spec, S, H, x.device)
            else:
                if (scales_out.shape, scales_out.stride(), scales_out.dtype) != geo or \
                        scales_out.device != x.device:
                    raise ValueError(f"scales_out must have shape {geo[0]}, strides {geo[1]}, dtype {geo[2]} "
                                     f"on {x.device}; got {tuple(scales_out.shape)}, {scales_out.stride()}, "
                                     f"{scales_out.dtype} on {scales_out.device}")
                if not torch.compiler.is_compiling():  # fake tensors have no address
                    check_scales_aligned(scales_out, spec)
    return residual_out, y_out, q_out, scales_out


def format_scalar(spec: Optional[QuantSpec]) -> str:
    """The scalar argument the format takes: "scale" (static FP8), "global_scale" (NVFP4) or ""."""
    return "" if spec is None else spec.info.scalar


def kernel_scalars(scalar: str, scale, global_scale) -> tuple:
    """(scale, global_scale) as the kernels take them for a format whose scalar is `scalar`
    (format_scalar): the one it uses, None for the other (an argument the format does not take is
    ignored, as the reference ignores it; a kernel compiled without it would refuse it)."""
    return (scale if scalar == "scale" else None,
            global_scale if scalar == "global_scale" else None)


def returned_scales(spec: Optional[QuantSpec], scale: Optional[Tensor],
                    scales_out: Optional[Tensor]) -> Optional[Tensor]:
    """The `scales` an op returns: the caller's scale for static fp8, else the scales output."""
    return scale if spec is not None and spec.info.scales == "static" else scales_out


def copy_outputs(ref, spec: Optional[QuantSpec], residual_out, y_out, q_out, scales_out,
                 allreduce_out=None) -> None:
    """Copy a reference NormQuantOutput into the outputs that were asked for (the CPU paths)."""
    for out, val in ((residual_out, ref.residual), (y_out, ref.y), (q_out, ref.q),
                     (allreduce_out, ref.allreduce)):
        if out is not None and val is not None:
            out.copy_(val)
    if scales_out is not None and spec is not None and spec.info.scale_dtype is not None:
        scales_out.copy_(ref.scales)


def inputs_look_valid(x, residual, weight, spec, eps) -> bool:
    """Cheap checks of the common case; when False, check_inputs says exactly what is wrong.
    Written for host time (every eager call runs it): each tensor attribute read once, strides
    as stride()[d] (stride(d) costs twice as much in torch 2.13 on the CPU)."""
    if (type(eps) is not float and type(eps) is not int) or not 0 <= eps < math.inf:
        return False
    if type(x) is not Tensor or type(weight) is not Tensor:
        return False
    shape = x.shape
    if len(shape) != 2 or x.dtype not in ACT_DTYPES:
        return False
    H = shape[1]
    if H % hidden_multiple(spec) or not MIN_HIDDEN <= H <= MAX_HIDDEN:
        return False
    dev = x.get_device()
    if (weight.shape != (H,) or weight.dtype != x.dtype or x.stride()[1] != 1
            or weight.stride()[0] != 1 or weight.get_device() != dev):
        return False
    if residual is not None and (type(residual) is not Tensor or residual.shape != shape
                                 or residual.dtype != x.dtype or residual.stride()[1] != 1
                                 or residual.get_device() != dev):
        return False
    return True


def scalar_looks_valid(t, x: Tensor) -> bool:
    """Cheap check of a scale / global_scale argument: a float32 one-element tensor on x's device."""
    return (type(t) is Tensor and t.dtype == torch.float32 and t.numel() == 1
            and t.get_device() == x.get_device())


