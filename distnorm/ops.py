"""User-facing single-GPU op: fused [residual add] + RMSNorm [+ quantization].

`add_rmsnorm` is registered as the `torch.library` custom op `distnorm::add_rmsnorm_out` (outputs
passed in and mutated), with a fake implementation for tracing, the CuTe kernel for CUDA tensors and
the reference for CPU tensors. In eager mode the wrapper calls the implementation directly: the
custom-op dispatcher costs several microseconds of host time that a decode step cannot spare.
"""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .args import (DTYPE_NAMES, allocate_outputs, check_op_inputs, check_rows_aligned, checked_mode,
                   copy_outputs, format_scalar, kernel_scalars, q_alignment, returned_scales,
                   check_scales_aligned, check_flags, check_outputs_apart)
from .kernels.tiling import cluster_sizes, fused_tiling, pad_clusters
from .formats import (NormQuantOutput, QuantSpec, kernel_spec, make_quant_spec, spec_code,
                      swizzled_tile_words)
from .rows import call_on_rows


# ---- kernel dispatch ----------------------------------------------------------------------------

FEW_ROWS = 64  # up to this many rows a long row may be spread over a cluster (cluster_for)
DECODE_ROWS = 48  # up to this many rows the 4-CTA spread pays (measured at 40, not at 64)
# up to these many rows, rows spread over a cluster are also split (formats with a scale per group:
# 4 parts up to 8 rows, then per-group FP8 2 up to 16; others 2 up to 8): _split_rows
SPLIT_CLUSTER_ROWS = (8, 16)
STATIC_SPLIT_ROWS = 32  # static FP8 from H = 8192 keeps 4 parts up to this many rows: _split_rows
# swizzled calls of these many rows on one CTA per row in parts, from this H, take one CTA per SM
# where the grid fits the SMs: NOTE [one CTA per SM] in kernels/fused_norm.py; _one_cta_per_sm
PACKED_ROWS = (18, 31)
PACKED_MIN_H = 8192
H200_SMS = 132  # the SM count assumed without a GPU (precompiling on a CPU): H100 / H200 SXM


class FusedKernelKey(NamedTuple):
    """compiled_fused_norm's arguments, by name (a tuple: `compiled_fused_norm(*key)`)."""
    dtype: str
    hidden: int
    quant: QuantSpec
    has_residual: bool
    gemma: bool
    write_y: bool
    cluster_n: int
    pdl: bool
    split: int
    slots: int
    one_cta_per_sm: bool


def cluster_for(H: int, M: int, spec: Optional[QuantSpec] = None) -> int:
    """Thread-block cluster size (CTAs sharing one row's threads through distributed shared memory)
    of the single-GPU kernel for M rows of H elements in format `spec`.

    Measured on H200 (benchmarks/results/cluster_ab_h200.md: M = 1, 16, 40, 64, H = 8192..32768,
    every format, cluster 1/2/4/8, cold L2): a cluster pays only from H = 16384 and only up to 64
    rows. Up to 48 rows (measured at 1, 16, 40): 4 CTAs, within 0.1 us of the best size at every
    point but bf16 output at M=1, H=32768 (8 CTAs: 0.2 us faster); 8 CTAs, chosen before, were 0.6-1.4
    us slower than 4 for the block-scaled formats at H=32768. 49 to 64 rows (measured at 64): 2
    CTAs at H = 32768 and for the block-scaled formats at H = 16384, else none. At H = 8192 the
    2-CTA cluster chosen before was 0.0-0.4 us slower than one CTA at every M and format (sizes
    between 8192 and 16384 are not measured and get none). Rounded down to a size that splits the
    row's threads into whole warps. The size never changes a row's bits (NOTE [batch invariance]
    in kernels/norm_quant.py).
    """
    return _cluster_size(H, _rows_bucket(M), spec)


def _rows_bucket(M: int) -> int:
    """The largest row count of M's bucket (the launch rules change only between buckets; many
    rows: FEW_ROWS + 1)."""
    return (SPLIT_CLUSTER_ROWS[0] if M <= SPLIT_CLUSTER_ROWS[0] else
            SPLIT_CLUSTER_ROWS[1] if M <= SPLIT_CLUSTER_ROWS[1] else
            PACKED_ROWS[0] - 1 if M < PACKED_ROWS[0] else
            PACKED_ROWS[1] if M <= PACKED_ROWS[1] else
            STATIC_SPLIT_ROWS if M <= STATIC_SPLIT_ROWS else
            DECODE_ROWS if M <= DECODE_ROWS else FEW_ROWS if M <= FEW_ROWS else FEW_ROWS + 1)


@functools.cache
def _cluster_size(H: int, rows: int, spec: Optional[QuantSpec]) -> int:
    block_scaled = spec is not None and spec.block_scaled
    if rows > FEW_ROWS or H < 16384:
        want = 1
    elif rows <= DECODE_ROWS:
        want = 4
    else:
        want = 2 if H >= 32768 or block_scaled else 1
    return max(n for n in cluster_sizes(H) if n <= want)


def fused_kernel_key(dtype: torch.dtype, H: int, spec: Optional[QuantSpec], has_residual: bool,
                     gemma: bool, write_y: bool, M: int, in_place: bool = False,
                     slots: int = 1) -> FusedKernelKey:
    """compiled_fused_norm's arguments (the compile-time key) for a call of M rows: what
    distnorm.kernels.precompile compiles ahead of the calls. in_place: an output starts where an
    input does (vLLM's in-place form; rows are then never split). slots: x is [slots, M, H]
    (NOTE [slots] in kernels/fused_norm.py)."""
    from .collectives.plan import pdl_from_env

    bucket = _rows_bucket(M)
    cluster = _cluster_size(H, bucket, spec)
    split = 1 if in_place else _split_rows(H, bucket, spec)
    return FusedKernelKey(DTYPE_NAMES[dtype], H, kernel_spec(spec), has_residual, gemma, write_y,
                          cluster, pdl_from_env(), split, slots,
                          one_cta_from_env() and _one_cta_per_sm(H, bucket, spec, cluster, split))


def one_cta_from_env() -> bool:
    """NOTE [one CTA per SM] unless DISTNORM_ONE_CTA_PER_SM=0 (read when a key is first compiled,
    as DISTNORM_PDL): an A/B lever for benchmarks, and for a norm that runs beside other streams'
    kernels, whose CTAs would have to leave an SM's shared memory before one of its could start."""
    return os.environ.get("DISTNORM_ONE_CTA_PER_SM", "1") != "0"


@functools.cache
def _one_cta_per_sm(H: int, rows: int, spec: Optional[QuantSpec], cluster: int, split: int) -> bool:
    """Whether calls of up to `rows` rows hold an SM per CTA (NOTE [one CTA per SM] in
    kernels/fused_norm.py): swizzled block scales (whose padding CTAs join the grid) on one CTA per
    row in parts, PACKED_ROWS[0] to PACKED_ROWS[1] rows from H = PACKED_MIN_H, when the grid of the
    bucket's largest call fits the GPU's SMs (none waits for a second wave)."""
    if not (spec is not None and spec.block_scaled and spec.swizzled and cluster == 1
            and split > 1 and H >= PACKED_MIN_H and PACKED_ROWS[0] <= rows <= PACKED_ROWS[1]):
        return False
    tiling = fused_tiling(H, cluster, spec.group_size)
    pads = pad_clusters(tiling, swizzled_tile_words(H // spec.group_size))
    return -(-rows // tiling.rows_per_cta) * split + pads <= _sm_count()


@functools.cache
def _sm_count() -> int:
    """SMs of the current GPU (H200_SMS without one: keys computed on a CPU)."""
    if not torch.cuda.is_available():
        return H200_SMS
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@functools.cache
def _split_rows(H: int, rows: int, spec: Optional[QuantSpec]) -> int:
    """CTAs (or clusters) per row (NOTE [split rows] in kernels/fused_norm.py) for calls of up to
    `rows` rows whose outputs start at none of their inputs. Measured on H200, cold L2:
    - rows on one CTA (benchmarks/results/decode_split_rule_h200.md, up to H = 8192): 4 up to 48
      rows (2 for FP8 with one scale per row, static or per-token: less arithmetic per element to
      spread, and per-token lost 6% with 4 at 48 rows); FP8 with one scale per row takes 4 from
      H = 8192 up to 16 rows (static since its scale is loaded after the row: NOTE [scalars after
      the row loads] in kernels/norm_quant.py; per-token gains at 12288 and is even at
      8192, one threshold for both; benchmarks/results/decode_parts_h200.md,
      split_corners_h200.md: static 1-16 x 8192 / 12288 -2..-8%, per-token 1-16 x 12288 -2..-10%,
      at 8192 -2..+1%, on CuTe DSL 4.3.5 and 4.8.1; below 8192 4 parts were up to 5% slower on
      4.8.1, per-token up to 6% on both); static FP8 keeps 4 parts up to 32 rows (24 / 32 x
      8192 / 12288 -1..-9% against 2, while at 48 rows 2 parts are 2-7% faster: split_mid_h200.md);
    - rows spread over a cluster (benchmarks/results/split_cluster_ab_h200.md, H = 16384 / 32768,
      M = 1, 2, 4, 8, 16, 48): a split loses from 48 rows in every format (up to 1.6x slower with
      4 parts) and from 16 for bf16 output and row-scaled FP8; the formats with a scale per group
      (per-group FP8, NVFP4, MX) take 4 parts up to 8 rows (per-group FP8 at 1 x 32768 3.74 ->
      2.55 us, NVFP4 3.53 -> 2.85), the others 2 up to 8 (per-token at 1 x 32768 2.91 -> 2.69
      with 4; 2 is as fast at 2 rows and faster at 8). From 9 to 16 rows per-group FP8 takes 2
      parts; NVFP4 / MX none: re-measured after the cheaper block scales and short chains
      (benchmarks/results/split_rule_9_16_h200.md, M = 8 / 12 / 16, two rounds), one part is
      as fast or up to 10% faster for them there (MXFP8 16 x 32768 3.58 -> 3.26 us, NVFP4 4.08
      -> 3.87) and per-group FP8 is best with 2."""
    if rows > DECODE_ROWS:
        return 1
    if _cluster_size(H, rows, spec) == 1:
        scales = spec.info.scales if spec is not None else None
        if scales in ("row", "static") and H < 8192:
            return 2
        if scales == "row" and rows > SPLIT_CLUSTER_ROWS[1]:
            return 2
        if scales == "static" and rows > STATIC_SPLIT_ROWS:
            return 2
        return 4
    if spec is not None and spec.grouped:
        if rows <= SPLIT_CLUSTER_ROWS[0]:
            return 4
        return 2 if rows <= SPLIT_CLUSTER_ROWS[1] and not spec.block_scaled else 1
    return 2 if rows <= SPLIT_CLUSTER_ROWS[0] else 1


def _writes_where_it_reads(x, residual, residual_out, y_out, q_out) -> bool:
    """Whether an output starts where an input does (vLLM's in-place form writes y over x and the
    new residual over residual): a split row must not overwrite a row that another part of it may
    still be loading (NOTE [split rows] in kernels/fused_norm.py). Any other overlap of an output
    with an input is already a race between rows, split or not. Written out for host time (0.6 us
    on a slow CPU; a generator over the tensors took 1.4)."""
    starts = (x.data_ptr(), 0 if residual is None else residual.data_ptr())
    return ((residual_out is not None and residual_out.data_ptr() in starts)
            or (y_out is not None and y_out.data_ptr() in starts)
            or (q_out is not None and q_out.data_ptr() in starts))


class _CallKernels:
    """The kernels one call key may launch: split rows (`split` > 1) or, for a call that writes
    where it reads, one CTA per row. Each is compiled on its first use, so an in-place call
    (vLLM's form) never compiles the split kernel it cannot use (about a second per key). Also
    holds the format's scalar argument, which an eager call would otherwise look up (host time)."""

    __slots__ = ("key", "slots", "split", "kernel", "in_place_kernel", "scalar")

    def __init__(self, key: tuple, slots: int = 1):
        self.key = key
        self.slots = slots  # NOTE [slots] in kernels/fused_norm.py
        self.split = fused_kernel_key(*key).split
        self.kernel = None
        self.in_place_kernel = None
        self.scalar = format_scalar(key[2])

    def compile(self, in_place: bool):
        """Compile (or load) and keep the kernel for calls in place or not."""
        from .kernels.compile import compiled_fused_norm

        kernel = compiled_fused_norm(*fused_kernel_key(*self.key, in_place, self.slots))
        if in_place:
            self.in_place_kernel = kernel
        else:
            self.kernel = kernel
        return kernel

    def launch(self, x, residual, weight, eps, scale, global_scale, residual_out, y_out, q_out,
               scales_out, outputs_given: bool = True) -> None:
        """Launch on x's rows (M > 0) with the outputs given; a scalar the format does not take is
        ignored. outputs_given=False: every output was allocated for this call, so none can start
        where an input does (the in-place check is skipped)."""
        if (self.split > 1 and outputs_given
                and _writes_where_it_reads(x, residual, residual_out, y_out, q_out)):
            kernel = self.in_place_kernel or self.compile(True)
        else:
            kernel = self.kernel or self.compile(False)
        kernel(x, residual, residual_out, weight, y_out, q_out, scales_out,
               *kernel_scalars(self.scalar, scale, global_scale), float(eps))


@functools.cache
def _call_kernels(dtype: torch.dtype, H: int, spec: Optional[QuantSpec], has_residual: bool,
                  gemma: bool, write_y: bool, rows_bucket: int, slots: int = 1) -> _CallKernels:
    """The kernels of one call's compile-time key; cached here as well as in compiled_fused_norm
    so that an eager call pays one dictionary lookup (host time). Programmatic dependent launch
    (DISTNORM_PDL, read when the key is first compiled) is on by default: with a PDL-aware
    predecessor the launch overlaps its tail (at M = 1 most of the kernel's time)."""
    return _CallKernels((dtype, H, spec, has_residual, gemma, write_y, rows_bucket), slots)


@functools.cache
def _eager_kernels(quant, group_size: int, sf_layout: str, scale_major: str, scale_ue8m0: bool,
                   dtype: torch.dtype, H: int, has_residual: bool, gemma: bool, write_y: bool,
                   rows_bucket: int) -> tuple:
    """(spec, _call_kernels(...)) of an eager call given by add_rmsnorm's own keywords: one
    dictionary lookup where make_quant_spec and _call_kernels would be two (host time). Raises
    (and caches nothing) for options make_quant_spec refuses; unhashable ones raise TypeError."""
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    return spec, _call_kernels(dtype, H, spec, has_residual, gemma, write_y, rows_bucket)


def clear_kernel_caches() -> None:
    """Forget the cached call kernels (_call_kernels, _eager_kernels): after a launch rule changed
    (benchmarks forcing a cluster size or split, tests faking the compiler)."""
    _call_kernels.cache_clear()
    _eager_kernels.cache_clear()


def run_fused_norm_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                          y_out, q_out, scales_out) -> None:
    """The kernel on checked arguments and allocated outputs. x: [M, H], or [N, M, H]: the rows
    of N ranks, summed in rank order before the residual add (NOTE [slots] in
    kernels/fused_norm.py; the all-reduce without peer memory)."""
    slots = 1 if x.dim() == 2 else x.shape[0]
    M, H = x.shape[-2:]
    if M == 0:
        return
    _call_kernels(x.dtype, H, spec, residual is not None, gemma, y_out is not None,
                  _rows_bucket(M), slots).launch(x, residual, weight, eps, scale, global_scale,
                                                 residual_out, y_out, q_out, scales_out)


def _run_reference(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                   q_out, scales_out) -> None:
    from .reference import add_rmsnorm_ref

    ref = add_rmsnorm_ref(x, residual, weight, eps, quant=spec, scale=scale,
                          global_scale=global_scale, gemma=gemma, norm_out=y_out is not None)
    copy_outputs(ref, spec, residual_out, y_out, q_out, scales_out)


def _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
          scales_out) -> None:
    check_rows_aligned((("x", x), ("residual", residual), ("residual_out", residual_out),
                        ("y_out", y_out), ("q_out", q_out, q_alignment(spec))), x.shape[0])
    check_scales_aligned(scales_out, spec)
    if x.is_cuda:
        run_fused_norm_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma,
                              residual_out, y_out, q_out, scales_out)
    else:
        _run_reference(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                       y_out, q_out, scales_out)


def _writes_y(norm_out: bool, quant, y_out: Optional[Tensor]) -> bool:
    """Whether a call writes T(y): asked for, passed an output for it, or without quantization
    (quant None, the only value make_quant_spec turns into no spec)."""
    return norm_out or quant is None or y_out is not None


def _launch_kernel_checked(x, residual, weight, eps, quant, group_size, sf_layout, scale_major,
                           scale_ue8m0, scale, global_scale, gemma, norm_out, residual_out, y_out,
                           q_out, scales_out) -> Optional[NormQuantOutput]:
    """The eager CUDA call with the argument checks left to the kernel's entry where it makes them:
    None when this call must take the Python-checked path (which raises the library's message).

    The compiled kernel's TVM-FFI entry checks, in C++ before it launches, every tensor against its
    compile-time signature: type (a tensor or None where the variant has one), dtype, rank, H, one
    row count M for all rows, last-dim stride 1, row-stride divisibility, data-pointer alignment, the
    device type (tried one by one on H100 and H200, 2026-11-24: each raised ValueError / TypeError)
    and one device index for all (the CuTe DSL binds every GPU tensor of a signature built from
    fake tensors to one device-id variable, 4.3.5 and 4.8). The Python checks of the same things
    cost 5-10 us of host time per call (args.py). What the entry cannot know is checked here: eps,
    the format's scalar being given, the exact strides of a scales output. Any failure, including
    one from the entry, sends the call to the checked path, which raises with the argument's name
    (or, if every check passes there, re-raises the kernel's own error). One cached lookup for the
    format and the kernels (_eager_kernels) instead of two (host time, benchmarks/README.md)."""
    if type(eps) is not float or not 0.0 <= eps < math.inf:
        return None
    try:
        M, H = x.shape
        if M == 0:
            return None
        write_y = _writes_y(norm_out, quant, y_out)
        spec, kernels = _eager_kernels(quant, group_size, sf_layout, scale_major, scale_ue8m0,
                                       x.dtype, H, residual is not None, gemma, write_y,
                                       _rows_bucket(M))
        scalar = kernels.scalar
        if scalar and (scale if scalar == "scale" else global_scale) is None:
            return None
        given = residual_out is not None or y_out is not None or q_out is not None
        residual_out, y_out, q_out, scales_out = allocate_outputs(
            x, spec, residual is not None, write_y, residual_out, y_out, q_out, scales_out,
            check_given=False)
        kernels.launch(x, residual, weight, eps, scale, global_scale, residual_out, y_out, q_out,
                       scales_out, given)
    except Exception:  # noqa: BLE001 - the checked path says what was wrong
        return None
    # tuple.__new__: the NamedTuple's own __new__ is a Python function (0.4 us of host time)
    return tuple.__new__(NormQuantOutput, (residual_out, y_out, q_out,
                                           returned_scales(spec, scale, scales_out), None))


# ---- torch.library registration -----------------------------------------------------------------
# The quant spec travels through the op schema as its code string (schemas take no dataclasses).

@torch.library.custom_op("distnorm::add_rmsnorm_out",
                         mutates_args=("residual_out", "y_out", "q_out", "scales_out"))
def _add_rmsnorm_out(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, quant: str,
                     scale: Optional[Tensor], global_scale: Optional[Tensor], gemma: bool,
                     residual_out: Optional[Tensor], y_out: Optional[Tensor], q_out: Optional[Tensor],
                     scales_out: Optional[Tensor]) -> None:
    _impl(x, residual, weight, eps, QuantSpec.from_code(quant), scale, global_scale, gemma,
          residual_out, y_out, q_out, scales_out)


@_add_rmsnorm_out.register_fake
def _(x, residual, weight, eps, quant, scale, global_scale, gemma, residual_out, y_out, q_out,
      scales_out) -> None:
    return None


def add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *,
                quant: Optional[str] = None, scale: Optional[Tensor] = None,
                global_scale: Optional[Tensor] = None, group_size: int = 128,
                sf_layout: str = "swizzled", scale_major: str = "row", scale_ue8m0: bool = False,
                gemma: bool = False, norm_out: bool = False, residual_out: Optional[Tensor] = None,
                y_out: Optional[Tensor] = None, q_out: Optional[Tensor] = None,
                scales_out: Optional[Tensor] = None) -> NormQuantOutput:
    """Fused [residual add] + RMSNorm [+ quantization] on one GPU (or the reference on CPU).

    x, residual: [..., H] bf16/fp16 (leading dims are flattened into M rows as a view; 2-D rows
    may be strided: last dim contiguous, 16-byte aligned rows); weight: [H] of x's dtype. quant: None | "fp8" | "fp8_per_token" | "fp8_per_group" | "nvfp4" |
    "mxfp8" | "mxfp4" (docs/SEMANTICS.md); fp8 needs `scale`, nvfp4 `global_scale` (float32 [1]).
    Returns NormQuantOutput(residual=h [M, H] when a residual is given, y=T(y) when norm_out or no
    quant, q, scales); residual, y and q have x's leading shape, scales the format's shape for the
    flattened M. Outputs passed in are written in place (residual_out may be `residual`).
    """
    if not isinstance(x, Tensor) or x.dim() != 2:  # subclasses (Parameter) too
        return call_on_rows(add_rmsnorm, x, residual, weight, eps, quant=quant, scale=scale,
                            global_scale=global_scale, group_size=group_size, sf_layout=sf_layout,
                            scale_major=scale_major, scale_ue8m0=scale_ue8m0, gemma=gemma,
                            norm_out=norm_out, residual_out=residual_out, y_out=y_out, q_out=q_out,
                            scales_out=scales_out)
    if type(gemma) is not bool or type(norm_out) is not bool:  # the inline test: host time
        check_flags(gemma=gemma, norm_out=norm_out)
    if x.is_cuda and not checked_mode() and not torch.compiler.is_compiling():
        out = _launch_kernel_checked(x, residual, weight, eps, quant, group_size, sf_layout,
                                     scale_major, scale_ue8m0, scale, global_scale, gemma,
                                     norm_out, residual_out, y_out, q_out, scales_out)
        if out is not None:
            return out
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    want_y = _writes_y(norm_out, quant, y_out)
    check_op_inputs(x, residual, weight, spec, scale, global_scale, eps)
    check_outputs_apart({"x": x, "residual": residual}, {
        "residual_out": residual_out, "y_out": y_out, "q_out": q_out, "scales_out": scales_out})
    residual_out, y_out, q_out, scales_out = allocate_outputs(
        x, spec, residual is not None, want_y, residual_out, y_out, q_out, scales_out)
    if torch.compiler.is_compiling():
        _add_rmsnorm_out(x, residual, weight, float(eps), spec_code(spec), scale, global_scale,
                         gemma, residual_out, y_out, q_out, scales_out)
    else:
        _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
              q_out, scales_out)
    return NormQuantOutput(residual_out, y_out, q_out, returned_scales(spec, scale, scales_out), None)
