"""Sequence-parallel ops: reduce-scatter + residual add + RMSNorm + quantization of this rank's row
shard, and the all-gather of quantized rows (and their scales) for the next column-parallel GEMM.

    out = reduce_scatter_add_rmsnorm(x, residual_shard, w, eps, workspace=ws, quant="fp8_per_token")
    q = all_gather(out.q, workspace=ws, rows=M); s = all_gather_scales(out.scales, ..., rows=M)
    # or in one call: reduce_scatter_add_rmsnorm(..., gather=True) -> out.q, out.scales for all M

Shard of rank r (collectives/rowsplit.py): with S = ceil(M / N), rows [min(M, r*S), min(M, (r+1)*S));
trailing ranks may own fewer rows, or none (M >= 0 always works). The shard's outputs are exactly
allreduce_add_rmsnorm's for those rows (ordered float32 sum, one rounding of h; bitwise, by batch
invariance), and the gathered q / scales are bitwise allreduce_add_rmsnorm's for all M.

With peer mappings the reduce-scatter is one kernel (algorithm "reducescatter" of
kernels/reducescatter.py: the two-shot push, then the norm-quant epilogue of the own shard), launched
per chunk when the call is larger than the buffer holds (NOTE [reduce-scatter chunks]); without
them, or when a call that needs chunks has rows that do not split evenly, torch.distributed
(all_to_all; the single-GPU kernel for the epilogue, the reference on CPU). Gathers (gather=True,
all_gather, all_gather_scales) go through the peer mappings when the workspace has them (the row
gather, kernels/rowgather.py: q, scales and y of a call in one launch per chunk of rows;
Tuning.gather_by = "nccl" or DISTNORM_GATHER_BY=nccl chooses torch.distributed), else
torch.distributed (all_gather). With gather=True on the kernel path the reduce-scatter kernel
writes y and q straight into its rows of the gathered tensors, gathered in place (no local copy).
"""
from __future__ import annotations

import logging

from typing import Optional

import torch
from torch import Tensor

from distnorm.args import (allocate_outputs, check_count, check_flags, check_op_inputs,
                           check_rows, check_rows_aligned, format_scalar, kernel_scalars,
                           returned_scales)
from distnorm.collectives.ops import _handle, _workspace
from distnorm.collectives.faults import after_launch, raise_if_failed
from distnorm.collectives.rowsplit import (gather_in_place, gather_rows, linear_spec,
                                           reduce_rows, scales_to_layout, scales_to_linear,
                                           slice_bounds, slice_epilogue)
from distnorm.comm.workspace import Workspace
from distnorm.formats import (NormQuantOutput, QuantSpec, check_hidden, empty_scales, kernel_spec,
                              make_quant_spec, pushed_scale_row_bytes, q_dtype, q_shape,
                              scales_geometry, spec_code)
from distnorm.rows import as_rows

__all__ = ["reduce_scatter_add_rmsnorm", "all_gather", "all_gather_scales", "shard_rows"]

log = logging.getLogger(__name__)


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
    check_count("M", M)
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
    check_flags(gemma=gemma, norm_out=norm_out, gather=gather)
    group, world, rank = _group_of(workspace)
    x2 = as_rows("x", x)
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    # x, weight, eps and the format's scalar as every op checks them (the residual is a shard)
    check_op_inputs(x2, None, weight, spec, scale, global_scale, eps)
    M, H = x2.shape
    start, stop = slice_bounds(M, world, rank)
    if residual is not None:
        check_rows("residual", residual, x2, (stop - start, H))
        residual = residual.detach()
    # an inference op, like the all-reduce ops (whose outputs are written in place): a TP layer's
    # weight is a Parameter, and torch.compile would trace a backward the op does not have
    x2, weight = x2.detach(), weight.detach()
    if torch.compiler.is_compiling():
        h, y, q, s = _reduce_scatter_op(x2, residual, weight, float(eps), spec_code(spec), scale,
                                        global_scale, gemma, norm_out, gather, _handle(workspace))
        return NormQuantOutput(h if residual is not None else None,
                               y if norm_out or spec is None else None,
                               q if spec is not None else None,
                               returned_scales(spec, scale, s if spec is not None else None), None)
    return _run(x2, residual, weight, eps, spec, scale, global_scale, gemma, norm_out, gather,
                workspace)


def _run(x2, residual, weight, eps, spec, scale, global_scale, gemma, norm_out, gather,
         workspace) -> NormQuantOutput:
    """reduce_scatter_add_rmsnorm on checked, 2-D arguments (row alignment checked here, at
    dispatch: torch.compile's fake tensors have no addresses)."""
    group, world, rank = _group_of(workspace)
    M, H = x2.shape
    start, stop = slice_bounds(M, world, rank)
    check_rows_aligned((("x", x2),), M)
    check_rows_aligned((("residual", residual),), stop - start)
    want_y = norm_out or spec is None
    local = stop - start
    has_scales = spec is not None and scales_geometry(spec, M, H) is not None
    full = {}  # gather=True on the kernel path: y / q written into the gathered tensors' rows
    S = -(-M // world)
    chunk, kspec, q_gathered, s_gathered, in_place = _kernel_gathers(workspace, x2, spec,
                                                                     gather, has_scales)
    # the kernel writes its rows of each gathered output (views of them), or the whole scales
    # output when it lays them out itself (NOTE [swizzled scales gathered])
    whole = s_gathered and _swizzled_by_kernel(kspec)
    if chunk:
        if gather:
            if want_y:
                full["y"] = torch.empty(world * S, H, dtype=x2.dtype, device=x2.device)
            if spec is not None:
                full["q"] = torch.empty(q_shape(spec, world * S, H), dtype=q_dtype(spec),
                                        device=x2.device)
            if in_place:
                full["scales"] = empty_scales(kspec, M if whole else world * S, H, x2.device)
        views = {k: t if k == "scales" and whole else t[rank * S:rank * S + local]
                 for k, t in full.items()}
        out = _shard_by_kernel(workspace, x2, residual, weight, eps, kspec, scale, global_scale,
                               gemma, want_y, local, views, chunk,
                               "rsgather" if q_gathered else "reducescatter", M if whole else local)
        shard_scales = out.scales if has_scales and gather else None  # in kspec's layout
    else:
        out = slice_epilogue(reduce_rows(x2, group), x2.dtype, residual, weight, eps, spec, scale,
                             global_scale, gemma, want_y, False)
        shard_scales = out.scales if has_scales else None  # linear
        if has_scales:
            out = out._replace(scales=_in_layout(shard_scales, spec, local, H))
    if not gather:
        return out._replace(scales=out.scales if spec is not None else None)
    shards = {"q": None if q_gathered else out.q, "scales": None if s_gathered else shard_scales,
              "y": out.y}
    got = _gather(workspace, {k: t for k, t in shards.items() if t is not None}, full, M)
    if q_gathered:
        got["q"] = full["q"][:M]
    s = out.scales
    if s_gathered:  # the kernel gathered them: in spec's layout, or row-major linear
        s = full["scales"] if whole else _in_layout(full["scales"][:M], spec, M, H)
    elif has_scales:
        s = got["scales"] if "scales" in full else _in_layout(got["scales"], spec, M, H)
    return NormQuantOutput(out.residual, got.get("y"), got.get("q"),
                           s if spec is not None else None, None)


def _kernel_gathers(ws: Workspace, x2: Tensor, spec: Optional[QuantSpec], gather: bool,
                    has_scales: bool) -> tuple:
    """How the reduce-scatter kernel runs a call: (chunk, the kernel's spec, q gathered by it,
    scales gathered by it, scales written into the gathered tensor's rows). NOTE [gathered
    scales]: scales to gather are written by the kernel straight into their rows of the full
    output: pushed with q in one launch when their row-major linear rows are whole 4-byte units
    (in spec's layout when that is row-major, or swizzled, as the whole output, under gather_by
    "epilogue-swizzled", the default: NOTE [swizzled scales gathered] in
    kernels/reducescatter.py; under "epilogue" put in spec's layout once, after the kernel), else
    in spec's layout where it allows
    (_scales_in_place), else row-major and linear, as the row gather takes them, and put in spec's
    layout once, after it. Every rank computes it from the same call and workspace."""
    M, H = x2.shape
    world = ws.world_size
    S = -(-M // world)
    in_place = has_scales and gather and _scales_in_place(spec, M, S, world)
    kspec = linear_spec(spec) if has_scales and gather and not in_place else spec
    chunk = _kernel_chunk(ws, x2, kspec)
    if not (gather and spec is not None and chunk and chunk >= S):
        return chunk, kspec, False, False, in_place
    # one launch only: the kernel finds the gathered q from its shard's view at rank * S rows, and
    # a chunk's view sits at rank * S + its offset
    # the rows the kernel of linear_spec(spec) pushes (column-major scales are computed row-major)
    pushed = pushed_scale_row_bytes(linear_spec(spec), H) if has_scales else 0
    if pushed and _q_in_epilogue(ws, spec, M, H, pushed):
        from distnorm.collectives.state import state_of

        # NOTE [swizzled scales gathered]: swizzled scales may be laid out by the kernel
        swizzled = _swizzled_by_kernel(spec) and \
            state_of(ws).tuning.gather_by == "epilogue-swizzled"
        return chunk, spec if swizzled else linear_spec(spec), True, True, True
    # the kernel of a spec with pushed scale rows always pushes them: none unless they fit
    q_gathered = not pushed and _q_in_epilogue(ws, spec, M, H)
    return chunk, kspec, q_gathered, False, in_place


def _swizzled_by_kernel(kspec: Optional[QuantSpec]) -> bool:
    """Whether a kernel that gathers kspec's scales (s_gathered) writes them as the full output,
    swizzled (NOTE [swizzled scales gathered] in kernels/reducescatter.py), rather than into the
    shard's rows of a row-major tensor."""
    return kspec is not None and kspec.block_scaled and kspec.swizzled


def _scales_in_place(spec: QuantSpec, M: int, S: int, world: int) -> bool:
    """NOTE [gathered scales]: whether each shard's scales, in spec's layout, are its rows of the
    full output's (so the kernel writes them there and the gather copies nothing locally):
    row-major layouts always; the 128x4 swizzled one when every shard is S whole 128-row tiles
    (M = world x S), its tiles then concatenating in shard order; column-major never."""
    if spec.col_major:
        return False
    if spec.block_scaled and spec.swizzled:
        return S > 0 and S % 128 == 0 and M == world * S
    return True


def _gather(ws: Workspace, shards: dict, in_place: dict, M: int) -> dict:
    """Every rank's rows of each shard [M_r, ...], in row order: {name: [M, ...]}, through the
    peers in one launch (collectives/peergather.py) or by torch.distributed. in_place[name]: a
    [N * S, ...] tensor (S = ceil(M / N)) that already holds this rank's rows (gathered in place:
    no local copy)."""
    from distnorm.collectives.peergather import gather_by_peers

    group, world, rank = _group_of(ws)
    S = -(-M // world)
    fulls = {k: in_place[k] if k in in_place else t.new_empty((world * S,) + tuple(t.shape[1:]))
             for k, t in shards.items()}
    parts = [(fulls[k][rank * S:rank * S + t.shape[0]] if k in in_place else t, fulls[k])
             for k, t in shards.items()]
    if gather_by_peers(ws, parts, M):
        return {k: f[:M] for k, f in fulls.items()}
    return {k: gather_in_place(in_place[k], M, group) if k in in_place else
            gather_rows(t, M, group) for k, t in shards.items()}


def _output_specs(x: Tensor, residual, spec, norm_out: bool, gather: bool, world: int, rank: int):
    """(shape, stride, dtype) of (h, y, q, scales) as _reduce_scatter_op returns them; (0,) when
    absent (static FP8's scales included: the caller's tensor)."""
    M, H = x.shape
    start, stop = slice_bounds(M, world, rank)
    rows = M if gather else stop - start
    none = ((0,), (1,), x.dtype)
    h = ((stop - start, H), (H, 1), x.dtype) if residual is not None else none
    y = ((rows, H), (H, 1), x.dtype) if norm_out or spec is None else none
    if spec is None:
        return h, y, none, none
    qs = q_shape(spec, rows, H)
    geo = scales_geometry(spec, rows, H)
    return h, y, (qs, (qs[1], 1), q_dtype(spec)), (geo if geo is not None else none)


@torch.library.custom_op("distnorm::reduce_scatter_add_rmsnorm", mutates_args=())
def _reduce_scatter_op(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                       quant: str, scale: Optional[Tensor], global_scale: Optional[Tensor],
                       gemma: bool, norm_out: bool, gather: bool, workspace: int
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op under torch.compile (functional: absent outputs are empty tensors)."""
    ws = _workspace(workspace)
    spec = QuantSpec.from_code(quant)
    out = _run(x, residual, weight, eps, spec, scale, global_scale, gemma, norm_out, gather, ws)
    specs = _output_specs(x, residual, spec, norm_out, gather, ws.world_size, ws.rank)
    got = (out.residual, out.y, out.q, None if spec is None or spec.kind == "fp8" else out.scales)
    return tuple(x.new_empty(0, dtype=d) if t is None else t
                 for t, (_, _, d) in zip(got, specs))


@_reduce_scatter_op.register_fake
def _(x, residual, weight, eps, quant, scale, global_scale, gemma, norm_out, gather, workspace):
    ws = _workspace(workspace)
    specs = _output_specs(x, residual, QuantSpec.from_code(quant), norm_out, gather,
                          ws.world_size, ws.rank)
    return tuple(x.new_empty_strided(shape, stride, dtype=d) for shape, stride, d in specs)


def _kernel_chunk(ws: Workspace, x: Tensor, spec: Optional[QuantSpec]) -> int:
    """Rows of every rank's shard per reduce-scatter launch (NOTE [reduce-scatter chunks]), or 0:
    torch.distributed (no peer mappings, a CPU or empty x, or a call that needs chunks but whose
    rows do not split evenly over the ranks)."""
    if not (x.is_cuda and ws.p2p_ok) or x.shape[0] == 0:
        return 0
    from distnorm.collectives.plan import SWIZZLE_ROWS, max_chunk_rows

    M, H = x.shape
    world = ws.world_size
    S = -(-M // world)
    try:
        cap = max_chunk_rows("reducescatter", world, M, H, x.element_size(), ws.buffer_bytes,
                             False, False)
    except ValueError:
        cap = 0
    if cap >= M:
        return S
    per_rank = cap // world
    if spec is not None and spec.block_scaled and spec.swizzled:
        per_rank = per_rank // SWIZZLE_ROWS * SWIZZLE_ROWS
    if M % world == 0 and per_rank >= 1:
        return per_rank
    from distnorm.collectives.state import state_of

    state = state_of(ws)
    if not state.scatter_fallback_logged:  # once per workspace: a serving loop would repeat it
        state.scatter_fallback_logged = True
        if M % world:
            why = f"its rows do not split evenly over {world} ranks"
        elif cap // world:
            why = (f"a launch holds {cap // world} rows of each rank's shard, fewer than one "
                   f"{SWIZZLE_ROWS}-row tile of swizzled scales")
        else:
            why = "a launch holds no row of each rank's shard"
        log.warning("distnorm.reduce_scatter_add_rmsnorm: %d x %d does not fit the workspace's "
                    "buffer of %d bytes in one launch, and %s (chunks need that); using "
                    "torch.distributed (logged once per workspace; a larger buffer_bytes keeps "
                    "it in the kernel)", M, H, ws.buffer_bytes, why)
    return 0


# NOTE [reduce-scatter chunks]
# A call larger than the buffer's lower half runs in launches of c rows of every rank's shard:
# launch k reduces rows [k c, (k + 1) c) of each shard, which sit in world blocks of x, so they are
# first copied into one contiguous [world * c, H] tensor (the kernel's x: its row split hands
# rank r block r). Each launch's outputs are the shards' rows [k c, (k + 1) c) (swizzled scales:
# c a multiple of 128, so launches start on whole scale tiles). The copy costs a read and a write
# of x, against the torch.distributed path's all_to_all (about 3x the kernel's time at
# 16384 x 8192 on 2 x H200). Only when M splits evenly (every shard full, as vLLM's sequence
# parallelism pads tokens to); other M that do not fit take torch.distributed.


def _q_in_epilogue(ws: Workspace, spec: QuantSpec, M: int, H: int,
                   scale_row_bytes: int = 0) -> bool:
    """Whether the reduce-scatter kernel gathers q itself (NOTE [gather in the epilogue] in
    kernels/reducescatter.py): Tuning.gather_by "epilogue", q rows of whole 16-byte units, every rank's
    q rows ([N][S] rows, and as many scale rows of scale_row_bytes when they go too) in the upper
    half of the buffer's general part, and no empty shard (the kernel finds the full q through
    its shard's view, and torch gives an empty view address 0). Every rank computes it from the
    same call and workspace, so they agree."""
    from distnorm.collectives.layout import lamport_split, push_half
    from distnorm.collectives.plan import GATHERS_IN_EPILOGUE
    from distnorm.collectives.state import state_of

    if state_of(ws).tuning.gather_by not in GATHERS_IN_EPILOGUE:
        return False
    q_row_bytes = q_shape(spec, 1, H)[1]  # one byte per element or per two (packed fp4)
    general = lamport_split(ws.buffer_bytes)[0]
    upper = general - push_half(general)
    S = -(-M // ws.world_size)
    rows_bytes = ws.world_size * S * (q_row_bytes + scale_row_bytes)
    return (q_row_bytes % 16 == 0 and rows_bytes <= upper
            and M - (ws.world_size - 1) * S > 0)


def _shard_by_kernel(ws: Workspace, x: Tensor, residual, weight, eps, spec, scale, global_scale,
                     gemma, want_y, local, given: dict, chunk: int,
                     algo: str = "reducescatter", scale_rows: int = -1) -> NormQuantOutput:
    """The reduce-scatter kernel: shard outputs, scales in spec's layout for the shard's rows;
    given: "y" / "q" / "scales" outputs to write (the shard's rows of the gathered tensors; NOTE
    [gathered scales] for when scales are among them); chunk: shard rows
    per launch (NOTE [reduce-scatter chunks]); algo "rsgather" (one launch) also fills the rest of
    q's gathered tensor (given["q"] is a view of it); scale_rows: the rows of the scales' layout
    (default `local`; M when given["scales"] is the whole gathered output, NOTE [swizzled scales
    gathered])."""
    from distnorm.collectives.dispatch import _rows, _scale_rows
    from distnorm.collectives.state import state_of

    state = state_of(ws)
    residual_out, y_out, q_out, scales_out = allocate_outputs(
        x[:local], spec, residual is not None, want_y, None, given.get("y"), given.get("q"),
        given.get("scales"), scale_rows=scale_rows)
    if chunk >= local:
        _launch_scatter(ws, state, x, residual, residual_out, weight, y_out, q_out, scales_out,
                        spec, scale, global_scale, gemma, eps, algo)
    else:
        world, H = ws.world_size, x.shape[1]
        blocks = x.unflatten(0, (world, local))  # chunks need M = world * local (_kernel_chunk)
        for a in range(0, local, chunk):
            b = min(local, a + chunk)
            _launch_scatter(ws, state, blocks[:, a:b].reshape(world * (b - a), H),
                            _rows(residual, a, b), _rows(residual_out, a, b), weight,
                            _rows(y_out, a, b), _rows(q_out, a, b),
                            _scale_rows(spec, scales_out, a, b), spec, scale, global_scale, gemma,
                            eps)
    return NormQuantOutput(residual_out, y_out, q_out, returned_scales(spec, scale, scales_out),
                           None)


def _launch_scatter(ws: Workspace, state, x: Tensor, residual, residual_out, weight, y_out, q_out,
                    scales_out, spec, scale, global_scale, gemma, eps,
                    algo: str = "reducescatter") -> None:
    """One reduce-scatter launch over x [world * rows, H]: this rank's rows into the outputs."""
    from distnorm.collectives.dispatch import ROWS_PER_CTA_ARG, allreduce_kernel_key
    from distnorm.kernels.compile_allreduce import compiled_allreduce

    kspec = kernel_spec(spec)
    key = allreduce_kernel_key(algo, ws.world_size, x.dtype, x.shape[1], spec, residual is not None,
                               gemma, y_out is not None, False, state.tuning,
                               x.numel() * x.element_size())
    kernel = compiled_allreduce(*key)
    state.check_signal_pad(ws)
    raise_if_failed(ws)
    kernel(x, residual, residual_out, weight, y_out, q_out, scales_out,
           *kernel_scalars(format_scalar(spec), scale, global_scale), None,
           state.buffer_table(ws, algo), ws.signal_ptrs, ws.error_flag_device, ws.rank,
           state.tuning.ctas(algo, state.grid_cap(x.device, x.shape[1], kspec,
                                                  key[ROWS_PER_CTA_ARG]), ws.world_size),
           float(eps), state.tuning.timeout_ns)
    state.epilogue_gathers += algo == "rsgather"
    after_launch(ws, x.device)


def all_gather(t: Tensor, *, workspace: Workspace, rows: int) -> Tensor:
    """Every rank's shard t [M_r, ...] (any dtype: bf16 rows, FP8 / packed FP4 q) in row order:
    [rows, ...] on every rank. rows: the full M (each shard must have its shard_rows size)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    check_count("rows", rows)
    group, world, rank = _group_of(workspace)
    start, stop = slice_bounds(rows, world, rank)
    if t.dim() < 1 or t.shape[0] != stop - start:
        raise ValueError(f"t must be this rank's shard of {rows} rows: {stop - start} rows, got "
                         f"{tuple(t.shape)}")
    return _gather(workspace, {"t": t}, {}, rows)["t"]


def all_gather_scales(scales: Tensor, *, workspace: Workspace, rows: int, hidden: int,
                      quant: str, group_size: int = 128, sf_layout: str = "swizzled",
                      scale_major: str = "row", scale_ue8m0: bool = False) -> Tensor:
    """The scales of every rank's shard (as reduce_scatter_add_rmsnorm returned them, in the
    format's layout for the shard's rows) as the scales of all `rows` rows in the same layout:
    the 128x4 swizzled layout is re-tiled for the full M, not concatenated."""
    check_count("rows", rows)
    check_count("hidden", hidden, 1)
    group, world, rank = _group_of(workspace)
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    if spec is None or scales_geometry(spec, rows, hidden) is None:
        raise ValueError(f"quant={quant!r} has no scales output to gather")
    check_hidden(spec, hidden)
    start, stop = slice_bounds(rows, world, rank)
    shape, _, dtype = scales_geometry(spec, stop - start, hidden)
    if not isinstance(scales, Tensor):
        raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
    if tuple(scales.shape) != shape or scales.dtype != dtype:
        raise ValueError(f"scales must be this rank's {stop - start} of {rows} rows in quant="
                         f"{quant!r}'s layout: {shape} {dtype}, got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    linear = scales_to_linear(scales, spec, stop - start, hidden)
    full = _gather(workspace, {"s": linear}, {}, rows)["s"]
    return _in_layout(full, spec, rows, hidden)

