"""Collectives by row slices over torch.distributed (NCCL, gloo): what every path without peer
memory is built from, moving all-reduce traffic instead of N copies of x.

Row split (also the sequence-parallel ops' shard): with S = ceil(M / N), rank r owns rows
[min(M, r * S), min(M, (r + 1) * S)) -- trailing ranks may own fewer rows, or none.

- `reduce_rows(x, group)`: every rank sends each peer that peer's slice (all_to_all); rank r gets
  the ordered float32 sum x_0 + x_1 + ... of its slice (bitwise the peer kernels' sum).
- `slice_epilogue(...)`: residual add + RMSNorm + quantization of those rows with the single-GPU
  kernel (the reference on CPU): bitwise what the peer kernels write for the same rows, since a
  row's outputs do not depend on the kernel (NOTE [batch invariance] in kernels/norm_quant.py).
- `gather_rows(t, M, group)`: every rank's slice back in row order (all_gather), any dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from distnorm.formats import NormQuantOutput, QuantSpec, from_swizzled, swizzle_into

__all__ = ["slice_bounds", "exchange_slices", "fold_slices", "row_bytes", "reduce_rows", "slice_epilogue", "gather_rows", "gather_in_place", "linear_spec",
           "scales_to_layout", "scales_to_linear", "allreduce_by_slices", "FlatSplit"]


def slice_bounds(M: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's rows (module docstring)."""
    S = -(-M // world)
    start = min(M, rank * S)
    return start, min(M, start + S)


def gather_into_tensor(out: Tensor, inp: Tensor, group=None, async_op: bool = False):
    """torch.distributed's all-gather of equal parts into one tensor: all_gather_single where torch
    has it (from 2.12 all_gather_into_tensor is a deprecated alias that warns at every call),
    all_gather_into_tensor before. out: [world * n, ...], inp: [n, ...]."""
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)


def _world_rank(group) -> tuple[int, int]:
    import torch.distributed as dist
    return dist.get_world_size(group), dist.get_rank(group)


def exchange_slices(x: Tensor, group, async_op: bool = False):
    """all_to_all of the row split of x [M, H] over group's N ranks: [N, S, H] (S = ceil(M / N)),
    entry s = rank s's rows of this rank's slice, zero-padded to S rows. async_op: (that tensor,
    the collective's Work), to be waited on before the tensor is read."""
    import torch.distributed as dist

    world, _ = _world_rank(group)
    M, H = x.shape
    S = -(-M // world)
    if M == world * S and x.is_contiguous():
        send = x
    else:
        send = x.new_zeros(world * S, H)
        send[:M] = x
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return (recv.view(world, S, H), work) if async_op else recv.view(world, S, H)


def fold_slices(parts: Tensor, rows: int, acc: Optional[Tensor] = None) -> Tensor:
    """The running float32 sum acc + parts[0] + parts[1] + ... in that order over the first `rows`
    rows of each part (acc None: it starts from parts[0]): float32 [rows, H]."""
    if acc is None:
        acc, parts = parts[0, :rows].float(), parts[1:]
    for p in parts:
        acc = acc + p[:rows].float()
    return acc


def reduce_rows(x: Tensor, group) -> Tensor:
    """This rank's slice of the ordered float32 sum of every rank's x [M, H]: float32 [M_r, H]."""
    world, rank = _world_rank(group)
    start, stop = slice_bounds(x.shape[0], world, rank)
    return fold_slices(exchange_slices(x, group), stop - start)


def linear_spec(spec: Optional[QuantSpec]) -> Optional[QuantSpec]:
    """The spec with row-major, linear scales (what slices are computed and gathered in)."""
    if spec is None or not (spec.swizzled or spec.col_major):
        return spec
    from dataclasses import replace
    return replace(spec, sf_layout="linear", scale_major="row")


def slice_epilogue(acc: Tensor, dtype: torch.dtype, residual: Optional[Tensor], weight: Tensor,
                   eps: float, spec: Optional[QuantSpec], scale, global_scale, gemma: bool,
                   want_y: bool, want_allreduce: bool) -> NormQuantOutput:
    """h = T(acc + float(residual)) (or T(acc)), then RMSNorm + quantization of the rows with
    linear, row-major scales. acc: float32 [rows, H]; residual: [rows, H] or None."""
    from distnorm.ops import add_rmsnorm

    h = (acc + residual.float()).to(dtype) if residual is not None else acc.to(dtype)
    out = add_rmsnorm(h, None, weight, eps, quant=linear_spec(spec), scale=scale,
                      global_scale=global_scale, gemma=gemma, norm_out=want_y)
    return out._replace(residual=h if residual is not None else None,
                        allreduce=acc.to(dtype) if want_allreduce else None)


def row_bytes(t: Tensor) -> Tensor:
    """t [rows, ...] of any dtype as contiguous bytes uint8 [rows, bytes per row] (what the
    collectives move: gloo has no float8). Through 1-D: a [rows, 1] tensor may carry a 0 stride
    that byte views reject."""
    per_row = math.prod(t.shape[1:]) * t.element_size()  # from the shape: t may have no rows
    return t.reshape(-1).contiguous().view(torch.uint8).reshape(t.shape[0], per_row)


def gather_rows(t: Tensor, M: int, group) -> Tensor:
    """Every rank's rows t [M_r, ...] of the row split, in row order: [M, ...] (any dtype)."""
    world, _ = _world_rank(group)
    S = -(-M // world)
    shape = tuple(t.shape[1:])
    raw = row_bytes(t)
    send = torch.zeros(S, raw.shape[1], dtype=torch.uint8, device=t.device)
    send[:t.shape[0]] = raw
    out = torch.empty(world * S, raw.shape[1], dtype=torch.uint8, device=t.device)
    gather_into_tensor(out, send, group=group)
    return out[:M].view(t.dtype).reshape((M,) + shape)


def gather_in_place(full: Tensor, M: int, group) -> Tensor:
    """full [N * S, ...] (S = ceil(M / N)) whose rows [r * S, r * S + M_r) this rank r already
    holds: every rank's rows gathered into it, in place (NCCL then copies nothing locally; no send
    buffer), and returned as full[:M]. Rows past a shard's own hold what they held."""
    import torch.distributed as dist

    world, rank = _world_rank(group)
    S = full.shape[0] // world
    raw = row_bytes(full)  # a view: full is contiguous
    mine = raw[rank * S:(rank + 1) * S]
    if dist.get_backend(group) != "nccl":
        mine = mine.clone()  # gloo: no input inside the output
    gather_into_tensor(raw, mine, group=group)
    return full[:M]


def scales_to_layout(linear: Tensor, spec: QuantSpec, out: Tensor) -> None:
    """Write row-major linear scales [M, K] into `out`, the op's scales tensor in spec's layout."""
    if spec.block_scaled and spec.swizzled:
        swizzle_into(linear, out)
    else:
        out.copy_(linear)  # column-major out: copy_ transposes


def scales_to_linear(scales: Tensor, spec: QuantSpec, M: int, H: int) -> Tensor:
    """The row-major linear [M, K] view/copy of scales in spec's layout."""
    if spec.block_scaled and spec.swizzled:
        return from_swizzled(scales, M, H // spec.group_size)
    return scales.contiguous()


class FlatSplit:
    """The group's N-way row split (module docstring) as the steps allreduce_by_slices takes:
    bounds(M) (this rank's slice), reduce(x) (its float32 sum), gather(t, M, like) (every slice in
    row order). nodechain.NodeChain is the other form."""

    def __init__(self, group) -> None:
        self.group = group
        self.world, self.rank = _world_rank(group)

    def bounds(self, M: int) -> tuple[int, int]:
        return slice_bounds(M, self.world, self.rank)

    def reduce(self, x: Tensor) -> Optional[Tensor]:
        return reduce_rows(x, self.group)

    def gather(self, t: Optional[Tensor], M: int, like: Tensor) -> Tensor:
        return gather_rows(t, M, self.group)


def allreduce_by_slices(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                        spec: Optional[QuantSpec], scale, global_scale, gemma: bool,
                        residual_out, y_out, q_out, scales_out, ar_out, split,
                        chunk_rows: int) -> None:
    """allreduce_add_rmsnorm's semantics over torch.distributed: per chunk of rows, the split's
    reduce, slice_epilogue where it returned a sum, the split's gather of every output into the
    (allocated) outputs; scales are gathered row-major linear and written in spec's layout at the
    end. split: FlatSplit(group) or nodechain.NodeChain."""
    M, H = x.shape
    want_y, want_ar = y_out is not None, ar_out is not None
    plain = residual_out is None and y_out is None and q_out is None
    gathers_scales = spec is not None and spec.info.scales in ("row", "group", "block")
    linear = None
    if gathers_scales and spec.block_scaled and spec.swizzled:
        linear = torch.empty(M, H // spec.group_size, dtype=scales_out.dtype, device=x.device)
    for a in range(0, M, chunk_rows):
        b = min(M, a + chunk_rows)
        acc = split.reduce(x[a:b])
        if plain:
            ar_out[a:b].copy_(split.gather(None if acc is None else acc.to(x.dtype), b - a, ar_out))
            continue
        out = None
        if acc is not None:
            s0, s1 = split.bounds(b - a)
            res = None if residual is None else residual[a + s0:a + s1]
            out = slice_epilogue(acc, x.dtype, res, weight, eps, spec, scale, global_scale, gemma,
                                 want_y, want_ar)
        for dst, field in ((residual_out, "residual"), (y_out, "y"), (ar_out, "allreduce"),
                           (q_out, "q")):
            if dst is not None:
                dst[a:b].copy_(split.gather(None if out is None else getattr(out, field), b - a, dst))
        if gathers_scales:
            dst = linear if linear is not None else scales_out
            dst[a:b].copy_(split.gather(None if out is None else out.scales, b - a, dst))
    if linear is not None:
        scales_to_layout(linear, spec, scales_out)
