"""Compile the all-reduce kernels once per compile-time key (fake tensors, TVM-FFI, symbolic M).

Key: (algo, world, dtype, H, quant, residual, gemma, write_y, write_allreduce, pdl, rows_per_cta,
form): form is one of plan.ALGORITHM_FORMS[algo] ("" = the default; "" for one-shot).
Rows, rank, grid size, eps, timeout and the peer-pointer tables are run-time arguments: a new token
count, a new workspace or a new rank never recompiles.

Call the result as
    f(x, res, res_out, w, y, q, scales, scale, gs, ar_out, buffer_ptrs, signal_ptrs, err,
      rank, max_ctas, eps, timeout_ns)
with the tensor conventions of kernels/compile.py plus: ar_out [M, H] T (plain all-reduce output),
buffer_ptrs / signal_ptrs int64 [world] (device), err int32 [4] (device-visible error words).
For algo "lamport", buffer_ptrs is int64 [3 * world] (entry k * world + s = rank s's area k) and the
areas must hold the sentinel (distnorm.collectives.state prepares both).
"""
from __future__ import annotations

import dataclasses

import cutlass
from cutlass import Float32, Int32, Int64

from distnorm.kernels import compat
from distnorm.kernels.allreduce import AllReduceAddRMSNormQuant
from distnorm.kernels.compile import CUTE_DTYPES, fake_norm_quant_args, fake_rows
from distnorm.kernels.rowgather import PeerRowGather
from distnorm.kernels.reducescatter import RS_ALGOS
from distnorm.collectives.plan import ALGORITHMS
from distnorm.formats import QuantSpec
from distnorm.kernels.tiling import RowTiling, choose_tiling


def allreduce_tiling(hidden: int, quant: QuantSpec, rows_per_cta: int = 0) -> RowTiling:
    """Thread layout of the all-reduce kernels: choose_tiling's, with rows_per_cta overridden when
    given (> 0)."""
    t = choose_tiling(hidden, 1, quant.group_size)
    if rows_per_cta > 0:
        t = dataclasses.replace(t, rows_per_cta=rows_per_cta)
    return t


def co_resident_ctas_per_sm(tiling: RowTiling) -> int:
    """CTAs per SM that are resident together whatever the kernel's register count: 256 threads of
    255 registers fill one SM's 64K registers; shared memory is a few hundred bytes. The barrier
    kernels need every CTA of the grid resident at once (kernels/allreduce.py)."""
    return max(1, 256 // tiling.threads)


@compat.compiled_kernel(AllReduceAddRMSNormQuant)
def compiled_allreduce(algo: str, world: int, dtype: str, hidden: int, quant: QuantSpec,
                       has_residual: bool, gemma: bool, write_y: bool,
                       write_allreduce: bool, pdl: bool = False, rows_per_cta: int = 0,
                       form: str = "") -> tuple:
    """The compiled all-reduce kernel of `algo` (this describes it; compat.compiled_kernel compiles
    and caches it)."""
    cdtype = CUTE_DTYPES[dtype]
    tiling = allreduce_tiling(hidden, quant, rows_per_cta)
    kernel = AllReduceAddRMSNormQuant(algo, world, tiling, quant, has_residual, gemma, write_y,
                                      write_allreduce, pdl, dtype, form)
    m = compat.sym_int(32)
    # reducescatter: x has the call's M rows, the outputs the shard's (another run-time count)
    m_out = compat.sym_int(32) if algo in RS_ALGOS else m
    x, res, res_out, w, y, q, s, scale, gs = fake_norm_quant_args(cdtype, hidden, quant, has_residual,
                                                                  write_y, m_out)
    if algo in RS_ALGOS:
        x = fake_rows(cdtype, hidden, m)
    ar = fake_rows(cdtype, hidden, m_out) if write_allreduce else None
    nptr = world * ALGORITHMS[algo].ptr_tables
    bufp = compat.make_fake_tensor(cutlass.Int64, (nptr,), (1,), assumed_align=8)
    sigp = compat.make_fake_tensor(cutlass.Int64, (world,), (1,), assumed_align=8)
    err = compat.make_fake_tensor(cutlass.Int32, (4,), (1,), assumed_align=16)
    stream = compat.make_fake_stream(use_tvm_ffi_env_stream=True)
    return kernel, (x, res, res_out, w, y, q, s, scale, gs, ar, bufp, sigp, err, Int32(0), Int32(1),
                    Float32(1e-6), Int64(1), stream)


@compat.compiled_kernel(PeerRowGather)
def compiled_rowgather(world: int, units: tuple, form: str = "") -> tuple:
    """The compiled row gather (kernels/rowgather.py) for `world` ranks and one copy unit (16 or 4
    bytes) per segment, in `form` (plan.ROWGATHER_FORMS; "" = the default); call as
    f(buffer_ptrs, signal_ptrs, err, src0, dst0, rb0, src1, dst1, rb1, src2, dst2, rb2, m, shard,
    row0, chunk_rows, rank, ctas, timeout_ns) with the addresses as ints (segments past
    len(units): zeros)."""
    kernel = PeerRowGather(world, tuple(units), form)
    bufp = compat.make_fake_tensor(cutlass.Int64, (world,), (1,), assumed_align=8)
    sigp = compat.make_fake_tensor(cutlass.Int64, (world,), (1,), assumed_align=8)
    err = compat.make_fake_tensor(cutlass.Int32, (4,), (1,), assumed_align=16)
    stream = compat.make_fake_stream(use_tvm_ffi_env_stream=True)
    segs = (Int64(0), Int64(0), Int32(16)) * 3
    return kernel, (bufp, sigp, err, *segs, Int32(1), Int32(1), Int32(0), Int32(1), Int32(0),
                    Int32(1), Int64(1), stream)
