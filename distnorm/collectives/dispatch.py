"""Running one all-reduce call: the CuTe kernels over peer mappings (chunked to fit the workspace),
or, without peer mappings, torch.distributed by row slices + the single-GPU kernel (CPU: the
reference).

Arguments are already checked and outputs allocated (collectives/ops.py). Semantics:
docs/SEMANTICS.md; outputs are bitwise identical on every rank.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import Tensor

from distnorm.args import (DTYPE_NAMES, check_rows_aligned, format_scalar, kernel_scalars,
                           q_alignment, check_scales_aligned)
from distnorm.collectives.faults import after_launch, raise_if_failed
from distnorm.collectives.plan import Tuning, plan_launch, sized_ladder
from distnorm.collectives.state import state_of
from distnorm.formats import MAX_HIDDEN, MIN_HIDDEN, VEC, QuantSpec, kernel_spec

log = logging.getLogger(__name__)

__all__ = ["run", "launch_eager", "gathered_sum", "PlannedCall"]


def _rows(t: Optional[Tensor], a: int, b: int) -> Optional[Tensor]:
    return None if t is None else t[a:b]


def _scale_rows(spec: Optional[QuantSpec], scales: Optional[Tensor], a: int, b: int):
    """The scale rows of rows [a, b) (swizzled [Mp, Kp]: chunks start at multiples of 128 and
    take their padding rows along)."""
    if scales is None or spec is None:
        return scales
    if spec.block_scaled and spec.swizzled:
        return scales[a:(b + 127) // 128 * 128]
    return scales[a:b]  # column-major per-group scales keep their column stride


ROWS_PER_CTA_ARG = 10  # where allreduce_kernel_key puts rows_per_cta


def allreduce_kernel_key(algo: str, world: int, dtype: torch.dtype, H: int,
                         spec: Optional[QuantSpec], has_residual: bool, gemma: bool, write_y: bool,
                         write_allreduce: bool, tuning: Optional[Tuning] = None,
                         nbytes: int = 0) -> tuple:
    """compiled_allreduce's arguments (the compile-time key) for a launch of `algo` (a concrete
    algorithm, after plan_launch) on `nbytes` of x (what a sized form goes by, plan's NOTE [sized
    forms]): what distnorm.kernels.precompile compiles ahead of the calls."""
    tuning = Tuning.from_env() if tuning is None else tuning
    ladder = sized_ladder(algo, spec is not None and spec.packed_fp4)
    return (algo, world, DTYPE_NAMES[dtype], H, kernel_spec(spec), has_residual, gemma, write_y,
            write_allreduce, tuning.pdl, tuning.rows(algo, nbytes, world),
            tuning.form(algo, nbytes, world, ladder))


def planned_kernel_key(algo: str, world: int, M: int, H: int, dtype: torch.dtype,
                       buffer_bytes: int, spec: Optional[QuantSpec], has_residual: bool,
                       gemma: bool, write_y: bool, write_allreduce: bool, plain: bool,
                       tuning: Optional[Tuning] = None) -> tuple[str, int, tuple]:
    """(algorithm, rows per launch, compiled_allreduce key) of a call of M x H rows over a data
    buffer of `buffer_bytes`: plan_launch, then the key of its launches (every launch of a chunked
    call takes the first chunk's kernel). What PlannedCall launches, and what the tests compile
    ahead of their calls."""
    kspec = kernel_spec(spec)
    chosen, step = plan_launch(algo, world, M, H, dtype.itemsize, buffer_bytes, kspec.swizzled,
                               write_allreduce and has_residual, plain)
    key = allreduce_kernel_key(chosen, world, dtype, H, kspec, has_residual, gemma, write_y,
                               write_allreduce, tuning, min(M, step) * H * dtype.itemsize)
    return chosen, step, key


class PlannedCall:
    """What a call of one shape launches over one workspace (collectives/state.py keeps one per
    call shape, so an eager call does not plan again: host time)."""

    __slots__ = ("algo", "step", "kernel", "ctas", "scalar")

    def __init__(self, ws, algo: str, M: int, H: int, dtype: torch.dtype,
                 spec: Optional[QuantSpec], has_residual: bool, gemma: bool, write_y: bool,
                 write_allreduce: bool, plain: bool) -> None:
        from distnorm.kernels.compile_allreduce import compiled_allreduce

        state = state_of(ws)
        kspec = kernel_spec(spec)
        self.algo, self.step, key = planned_kernel_key(
            algo, ws.world_size, M, H, dtype, ws.buffer_bytes, kspec, has_residual, gemma,
            write_y, write_allreduce, plain, state.tuning)
        self.kernel = compiled_allreduce(*key)
        self.ctas = state.tuning.ctas(self.algo, state.grid_cap(ws.device, H, kspec,
                                                                 key[ROWS_PER_CTA_ARG]),
                                      ws.world_size)
        self.scalar = format_scalar(spec)  # the one scalar argument the format takes


def _kernel_tail(call: PlannedCall, ws, state, ptrs, eps) -> tuple:
    """The all-reduce kernel's arguments after its tensors: peer tables, rank, grid cap, eps,
    barrier timeout (kernels/allreduce.py's __call__)."""
    return (ptrs, ws.signal_ptrs, ws.error_flag_device, ws.rank, call.ctas, float(eps),
            state.tuning.timeout_ns)


def run_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
               q_out, scales_out, ar_out, ws, algo: str) -> None:
    """The all-reduce kernels over `ws`'s peer mappings, in launches that fit its data buffer."""
    M, H = x.shape
    if M == 0:
        return
    state = state_of(ws)
    plain = residual_out is None and y_out is None and q_out is None
    call = state.planned_call(ws, algo, M, H, x.dtype, spec, residual is not None, gemma,
                              y_out is not None, ar_out is not None, plain)
    kernel, step = call.kernel, call.step
    state.check_signal_pad(ws)
    raise_if_failed(ws)  # pinned words: cheap; a failed workspace launches nothing until reset
    ptrs = (state.lamport_table(ws) if call.algo == "lamport"
            else state.buffer_table(ws, call.algo))
    scale, global_scale = kernel_scalars(call.scalar, scale, global_scale)
    tail = _kernel_tail(call, ws, state, ptrs, eps)
    if step >= M:  # one launch: the tensors as given (six row slices cost microseconds of host time)
        kernel(x, residual, residual_out, weight, y_out, q_out, scales_out, scale, global_scale,
               ar_out, *tail)
    else:
        for a in range(0, M, step):
            b = min(M, a + step)
            kernel(x[a:b], _rows(residual, a, b), _rows(residual_out, a, b), weight,
                   _rows(y_out, a, b), _rows(q_out, a, b), _scale_rows(spec, scales_out, a, b),
                   scale, global_scale, _rows(ar_out, a, b), *tail)
    after_launch(ws, x.device)


def launch_eager(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                 q_out, scales_out, ar_out, ws, algo: str) -> bool:
    """The eager CUDA call of one launch with the argument checks left to the kernel's entry (as
    ops._launch_kernel_checked does for the single-GPU op, which says what the entry checks: dtype,
    rank, H, one M for all rows, strides, alignment, one device): False, having launched nothing,
    when the call must take the checked path (collectives/ops.py), which raises the library's
    message or, if every check passes there, runs the call. What the entry cannot know is checked
    here: the workspace (open, with peer mappings, on x's device), eps, the format's scalar being
    given, the call fitting one launch (the lamport areas prepared), H in the kernels' range (no
    compile attempt for a size they refuse). Outputs are allocated."""
    if type(eps) is not float or not 0.0 <= eps < math.inf or not ws.p2p_ok:
        return False
    try:
        M, H = x.shape
        if (M == 0 or x.get_device() != ws.device_index or H % VEC
                or not MIN_HIDDEN <= H <= MAX_HIDDEN):
            return False
        state = state_of(ws)
        plain = residual_out is None and y_out is None and q_out is None
        call = state.planned_call(ws, algo, M, H, x.dtype, spec, residual is not None, gemma,
                                  y_out is not None, ar_out is not None, plain)
        scalar = call.scalar
        if call.step < M or scalar and (scale if scalar == "scale" else global_scale) is None:
            return False
        ptrs = state.buffer_table(ws, call.algo)
        if ptrs is None:  # the first lamport call prepares the areas (collective)
            return False
        state.check_signal_pad(ws)
        raise_if_failed(ws)
        scale, global_scale = kernel_scalars(scalar, scale, global_scale)
        call.kernel(x, residual, residual_out, weight, y_out, q_out, scales_out, scale,
                    global_scale, ar_out, *_kernel_tail(call, ws, state, ptrs, eps))
    except Exception:  # noqa: BLE001 - nothing launched; the checked path says what was wrong
        return False
    after_launch(ws, x.device)
    return True


def gathered_sum(x: Tensor, group) -> Tensor:
    """Ordered float32 sum of every rank's x (all-gather, then acc = x0 + x1 + ...): bitwise the
    reference on every rank."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def run_fallback(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                 q_out, scales_out, ar_out, ws) -> None:
    """No peer mappings (or CPU tensors): torch.distributed moves the rows and the single-GPU
    kernel (CPU: the reference) sums them in rank order and runs the epilogue
    (collectives/nopeer.py: all_gather of x, or all_to_all of row slices and all_gather of the
    outputs); with allreduce_out, for the plain all-reduce and for the node chain, by row slices
    with a float32 sum in torch (collectives/rowsplit.py). Bitwise the peer kernels' results.
    Chunked to the workspace's buffer size. Logs once per workspace why."""
    if x.is_cuda:
        state = state_of(ws)
        if not state.fallback_logged:
            state.fallback_logged = True
            reason = ws.fallback_reason or ("workspace is closed" if ws.closed else "no peer mappings")
            log.warning("distnorm all-reduce: using torch.distributed collectives + the single-GPU "
                        "kernel (%s)", reason)
    if x.shape[0] == 0:
        return
    from distnorm.collectives.rowsplit import FlatSplit, allreduce_by_slices

    split = row_split(ws)
    plain = residual_out is None and y_out is None and q_out is None
    if ar_out is None and not plain and isinstance(split, FlatSplit):
        from distnorm.collectives.nopeer import allreduce_no_peer

        allreduce_no_peer(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                          y_out, q_out, scales_out, ws.group, ws.buffer_bytes)
        return
    chunk = max(1, ws.buffer_bytes // (x.shape[1] * x.element_size()))
    allreduce_by_slices(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                        y_out, q_out, scales_out, ar_out, split, chunk)


def row_split(ws):
    """How the path without peer memory splits rows: the node chain (collectives/nodechain.py)
    when the workspace was given ranks_per_node G with 1 < G < group size, else the flat split."""
    from distnorm.collectives.rowsplit import FlatSplit

    G = ws.ranks_per_node
    if G is not None and 1 < G < ws.world_size:
        from distnorm.collectives.nodechain import NodeChain
        return ws.op_state("node_chain", lambda: NodeChain(ws.group, G))
    return ws.op_state("flat_split", lambda: FlatSplit(ws.group))


def run(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
        scales_out, ar_out, ws, algo: str) -> None:
    """One all-reduce call on checked arguments and allocated outputs."""
    check_rows_aligned((("x", x), ("residual", residual), ("residual_out", residual_out),
                        ("y_out", y_out), ("allreduce_out", ar_out),
                        ("q_out", q_out, q_alignment(spec))), x.shape[0])
    check_scales_aligned(scales_out, spec)
    if x.is_cuda and ws.p2p_ok:
        run_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                   q_out, scales_out, ar_out, ws, algo)
    else:
        run_fallback(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                     q_out, scales_out, ar_out, ws)
