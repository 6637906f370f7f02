"""Compile the fused kernels once per compile-time key, from fake tensors with a symbolic row count.

A new token count never recompiles: M and the row strides are run-time values. Compiled kernels
use the TVM-FFI calling convention and take the current torch stream implicitly.

Tensor conventions at the kernel boundary (the op layer makes these views):
- activations x, residual, residual_out, y: [M, H] bf16/fp16, last dim contiguous, rows 16-byte aligned;
- weight [H];
- q: float8_e4m3fn [M, H] for fp8 formats, uint8 [M, H/2] for fp4 (packed two per byte), as
  the op returns it (the kernels store int32 words through a recast row);
- scales: float32 [M, 1] (per-token), float32 [M, H/g] row- or column-major (per-group),
  float8_e4m3fn (nvfp4) / uint8 (mx) [M, K] (linear) or [Mp, Kp] (swizzled), as the op returns them;
- scale / global_scale: float32 [1].
"""
from __future__ import annotations


import cutlass
from cutlass import Float32

from distnorm.kernels import compat
from distnorm.kernels.fused_norm import FusedAddRMSNormQuant
from distnorm.formats import QuantSpec
from distnorm.kernels.tiling import fused_tiling

CUTE_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def fake_rows(dtype, cols: int, m, align: int = 16, row_div: int = 8):
    """A fake [m, cols] tensor with a run-time row stride (divisible by row_div elements)."""
    return compat.make_fake_tensor(dtype, (m, cols), (compat.sym_int(64, divisibility=row_div), 1),
                                   assumed_align=align)


def fake_scales(quant: QuantSpec, hidden: int, m):
    """Fake scale tensor for `quant` (None when the format has no scale output)."""
    scales = quant.info.scales
    if scales == "row":
        return compat.make_fake_tensor(Float32, (m, 1), (1, 1), assumed_align=4)
    if scales == "group":
        groups = hidden // quant.group_size
        stride = (1, compat.sym_int(64)) if quant.col_major else (groups, 1)
        return compat.make_fake_tensor(Float32, (m, groups), stride, assumed_align=4)
    if scales == "block":
        # the op's own dtype (nvfp4: float8_e4m3fn, mx: uint8 e8m0 codes) and 2-D shape, so the
        # host passes the tensor without views; the kernels store bytes (NormQuantCore._store_scale)
        dtype = cutlass.Float8E4M3FN if quant.kind == "nvfp4" else cutlass.Uint8
        k = hidden // quant.group_size
        if quant.swizzled:  # [round_up(M, 128), round_up(K, 4)]: its own row count
            kp = (k + 3) // 4 * 4
            return compat.make_fake_tensor(dtype, (compat.sym_int(32), kp), (kp, 1), assumed_align=4)
        return compat.make_fake_tensor(dtype, (m, k), (k, 1), assumed_align=1)
    return None


def fake_q(quant: QuantSpec, hidden: int, m):
    """q in the dtype the op returns (the kernel stores it as int32 words: NormQuantCore._quantize),
    so the host passes the caller's tensor without a view: float8_e4m3fn [M, H] with 8-byte
    aligned rows, or packed fp4 as uint8 [M, H/2] with 4-byte aligned rows."""
    if quant.info.scales == "none":
        return None
    if quant.packed_fp4:
        return compat.make_fake_tensor(cutlass.Uint8, (m, hidden // 2),
                                       (compat.sym_int(64, divisibility=4), 1), assumed_align=4)
    return compat.make_fake_tensor(cutlass.Float8E4M3FN, (m, hidden),
                                   (compat.sym_int(64, divisibility=8), 1), assumed_align=8)


def fake_norm_quant_args(cdtype, hidden: int, quant: QuantSpec, has_residual: bool, write_y: bool, m):
    """Fake (x, residual, residual_out, weight, y, q, scales, scale, global_scale) for m rows: the
    arguments every fused kernel takes, None where the variant does not use one."""
    x = fake_rows(cdtype, hidden, m)
    res = fake_rows(cdtype, hidden, m) if has_residual else None
    res_out = fake_rows(cdtype, hidden, m) if has_residual else None
    w = compat.make_fake_tensor(cdtype, (hidden,), (1,), assumed_align=16)
    y = fake_rows(cdtype, hidden, m) if write_y else None
    q = fake_q(quant, hidden, m)
    s = fake_scales(quant, hidden, m)
    scalar = quant.info.scalar
    scale = compat.make_fake_tensor(Float32, (1,), (1,), assumed_align=4) if scalar == "scale" else None
    gs = compat.make_fake_tensor(Float32, (1,), (1,), assumed_align=4) if scalar == "global_scale" else None
    return x, res, res_out, w, y, q, s, scale, gs


@compat.compiled_kernel(FusedAddRMSNormQuant)
def compiled_fused_norm(dtype: str, hidden: int, quant: QuantSpec, has_residual: bool, gemma: bool,
                        write_y: bool, cluster_n: int = 1, pdl: bool = False,
                        split: int = 1, slots: int = 1, one_cta_per_sm: bool = False) -> tuple:
    """The compiled single-GPU kernel (this describes it; compat.compiled_kernel compiles and caches
    it); call as f(x, res, res_out, w, y, q, scales, scale, gs, eps).
    pdl: launched as a programmatic dependent launch (kernels/fused_norm.py); split: CTAs
    (clusters) per row (NOTE [split rows] there); slots > 1: x is [slots, M, H], the rows summed
    over the slots in order (NOTE [slots] there); one_cta_per_sm: NOTE [one CTA per SM] there."""
    cdtype = CUTE_DTYPES[dtype]
    tiling = fused_tiling(hidden, cluster_n, quant.group_size)
    kernel = FusedAddRMSNormQuant(tiling, quant, has_residual, gemma, write_y, pdl, split, slots,
                                  one_cta_per_sm)
    m = compat.sym_int(32)
    args = fake_norm_quant_args(cdtype, hidden, quant, has_residual, write_y, m)
    if slots > 1:  # x [slots, M, H]: slot and row strides are run-time
        x = compat.make_fake_tensor(cdtype, (slots, m, hidden),
                                    (compat.sym_int(64, divisibility=8),
                                     compat.sym_int(64, divisibility=8), 1), assumed_align=16)
        args = (x, *args[1:])
    stream = compat.make_fake_stream(use_tvm_ffi_env_stream=True)
    return kernel, (*args, Float32(1e-6), stream)
