"""Sequence-parallel ops: reduce-scatter + residual add + RMSNorm + quantization of this rank's row
shard, and the all-gather of quantized rows (and their scales) for the next column-parallel GEMM.

    out = reduce_scatter_add_rmsnorm(x, residual_shard, w, eps, workspace=ws, quant="fp8_per_token")
    q = all_gather(out.q, workspace=ws, rows=M); s = all_gather_scales(out.scales, ..., rows=M)
    # or in one call: reduce_scatter_add_rmsnorm(..., gather=True) -> out.q, out.scales for all M

Shard of rank r (collectives/rowsplit.py): with S = ceil(M / N), rows [min(M, r*S), min(M, (r+1)*S));
trailing ranks may own fewer rows, or none (M >= 0 always works). The shard's outputs are exactly
allreduce_add_rmsnorm's for those rows (ordered float32 sum, one rounding of h; bitwise, by batch
invariance), and the gathered q / scales are bitwise allreduce_add_rmsnorm's for all M.

Today these ops run over torch.distributed (all_to_all, all_gather; the single-GPU kernel for the
epilogue, the reference on CPU) on every workspace: the peer-memory kernels are not written yet.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from distnorm.args import check_eps, check_rows
from distnorm.collectives.rowsplit import (gather_rows, reduce_rows, scales_to_layout, slice_bounds,
                                           slice_epilogue)
from distnorm.comm.workspace import Workspace
from distnorm.formats import (MAX_HIDDEN, MIN_HIDDEN, NormQuantOutput, QuantSpec, check_hidden,
                              empty_scales, make_quant_spec, scales_geometry)
from distnorm.rows import as_rows

__all__ = ["reduce_scatter_add_rmsnorm", "all_gather", "all_gather_scales", "shard_rows"]


def _group_of(workspace) -> tuple:
    import torch.distributed as dist

    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a distnorm.Workspace, got {type(workspace).__name__}")
    if workspace.closed:
        raise RuntimeError("workspace is closed")
    if workspace.group is None and not dist.is_initialized():
        raise RuntimeError("the sequence-parallel ops run over torch.distributed: build the "
                           "workspace over a ProcessGroup")
    return workspace.group, workspace.world_size, workspace.rank


def shard_rows(M: int, workspace: Workspace) -> tuple[int, int]:
    """[start, stop) of this rank's rows of M (the row split every sequence-parallel op uses)."""
    return slice_bounds(M, workspace.world_size, workspace.rank)


def _in_layout(linear: Tensor, spec: Optional[QuantSpec], rows: int, H: int) -> Optional[Tensor]:
    """Row-major linear scales [rows, K] in spec's layout (a new tensor)."""
    if spec is None or scales_geometry(spec, rows, H) is None:
        return None
    if not (spec.swizzled and spec.block_scaled) and not spec.col_major:
        return linear
    out = empty_scales(spec, rows, H, linear.device)
    scales_to_layout(linear, spec, out)
    return out


def reduce_scatter_add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor,
                               eps: float = 1e-6, *, workspace: Workspace,
                               quant: Optional[str] = None, scale: Optional[Tensor] = None,
                               global_scale: Optional[Tensor] = None, group_size: int = 128,
                               sf_layout: str = "swizzled", scale_major: str = "row",
                               scale_ue8m0: bool = False, gemma: bool = False,
                               norm_out: bool = False, gather: bool = False) -> NormQuantOutput:
    """Every rank passes its partial x [..., H] (M rows when flattened) and its residual shard
    [M_r, H] (or None); returns NormQuantOutput for the shard: residual = h [M_r, H], y [M_r, H]
    (norm_out or no quant), q [M_r, H] (fp4: [M_r, H/2]), scales in the format's layout for M_r
    rows. gather=True: q, scales (and y) for all M rows on every rank instead (residual stays the
    shard). Options as allreduce_add_rmsnorm."""
    group, world, rank = _group_of(workspace)
    x2 = as_rows("x", x)
    check_rows("x", x2, None, x2.shape)
    M, H = x2.shape
    if H % 8 or not MIN_HIDDEN <= H <= MAX_HIDDEN:
        raise ValueError(f"x's last dim H must be a multiple of 8 in [{MIN_HIDDEN}, {MAX_HIDDEN}], "
                         f"got {H}")
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    check_hidden(spec, H)
    check_eps(eps)
    start, stop = slice_bounds(M, world, rank)
    if residual is not None:
        check_rows("residual", residual, x2, (stop - start, H))
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (H,) or weight.dtype != x2.dtype:
        raise ValueError(f"weight must be a [{H}] tensor of x's dtype {x2.dtype}")
    acc = reduce_rows(x2, group)
    want_y = norm_out or spec is None
    out = slice_epilogue(acc, x2.dtype, residual, weight, eps, spec, scale, global_scale, gemma,
                         want_y, False)
    rows = M if gather else stop - start
    q, y, s = out.q, out.y, out.scales
    if gather:
        q = None if q is None else gather_rows(q, M, group)
        y = None if y is None else gather_rows(y, M, group)
        if s is not None and scales_geometry(spec, M, H) is not None:
            s = gather_rows(s, M, group)
    if spec is not None and scales_geometry(spec, rows, H) is not None:
        s = _in_layout(s, spec, rows, H)
    return NormQuantOutput(out.residual, y, q, s if spec is not None else None, None)


def all_gather(t: Tensor, *, workspace: Workspace, rows: int) -> Tensor:
    """Every rank's shard t [M_r, ...] (any dtype: bf16 rows, FP8 / packed FP4 q) in row order:
    [rows, ...] on every rank. rows: the full M (each shard must have its shard_rows size)."""
    group, world, rank = _group_of(workspace)
    start, stop = slice_bounds(rows, world, rank)
    if not isinstance(t, Tensor) or t.dim() < 1 or t.shape[0] != stop - start:
        raise ValueError(f"t must be this rank's shard of {rows} rows: {stop - start} rows, got "
                         f"{tuple(getattr(t, 'shape', ()))}")
    return gather_rows(t, rows, group)


def all_gather_scales(scales: Tensor, *, workspace: Workspace, rows: int, hidden: int,
                      quant: str, group_size: int = 128, sf_layout: str = "swizzled",
                      scale_major: str = "row", scale_ue8m0: bool = False) -> Tensor:
    """The scales of every rank's shard (as reduce_scatter_add_rmsnorm returned them, in the
    format's layout for the shard's rows) as the scales of all `rows` rows in the same layout:
    the 128x4 swizzled layout is re-tiled for the full M, not concatenated."""
    from distnorm.collectives.rowsplit import scales_to_linear

    group, world, rank = _group_of(workspace)
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    if spec is None or scales_geometry(spec, rows, hidden) is None:
        raise ValueError(f"quant={quant!r} has no scales output to gather")
    start, stop = slice_bounds(rows, world, rank)
    linear = scales_to_linear(scales, spec, stop - start, hidden)
    full = gather_rows(linear, rows, group)
    return _in_layout(full, spec, rows, hidden)

