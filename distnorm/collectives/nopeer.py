"""The fused all-reduce without peer memory (ranks on several nodes, PCIe without P2P): NCCL (gloo
on CPU) moves the rows, and the single-GPU kernel with slots sums them in rank order and runs the
epilogue in one pass (NOTE [slots] in kernels/fused_norm.py), so every output is bitwise the peer
kernels'.

NOTE [no-peer forms]
- gather: all_gather of x, then every rank folds all M rows and writes its outputs in place. One
  collective; each rank receives (N - 1) copies of x.
  Tried and dropped: x copied into its own slot of the receive buffer and the all_gather run in
  place (NCCL then skips its local copy: its all_gather alone 94.5 us against 100.1 at 2048 x 4096
  on 2 x H200) was slower as a whole at every size, the copy costing more than it saves (112.1 us
  against 108.0 there, 730.4 against 687.7 at 8192 x 8192; benchmarks/results/
  fallback_inplace_h200_x2.md).
- split: all_to_all of row slices (each rank receives its slice of every rank's x), the fold and
  epilogue of that slice into one packed buffer, then one all_gather of the packed buffers. Two
  collectives; each rank receives (N - 1) / N of x and (N - 1) / N of the outputs.
- split-h (with a residual): all_to_all of row slices, the fold of this rank's slice into h (its
  rows of residual_out, nothing else written), one all_gather of h in place, then the single-GPU
  op on every row of h without a residual (h's norm and quantization: bitwise the fold's, NOTE
  [batch invariance]). Two collectives with an all-reduce's traffic, (N - 1) / N of x and of h
  received, whatever the outputs; the epilogue runs on all M rows on every rank, as it does after
  an NCCL all-reduce.
`form_for` takes the form of least cost, counting its bytes received, each of its collectives'
fixed cost as COLLECTIVE_BYTES, and the gather form's local work (the all_gather's own copy of x,
the fold reading N copies) as 1/GATHER_LOCAL_SHARE of x's bytes. The two constants are fitted to
the crossovers measured on H200s over NVLink, per-token FP8 with a residual: at 2 ranks gather to
32 MiB of x (2048 x 8192: 191.7 us against split-h's 195.6), split-h from 64 MiB (8192 x 4096: 346.5
against 359.8; benchmarks/results/fallback_splith_h200_x2.md); at 4 ranks gather to 0.25 MiB (16 x
8192: 15.8 against 21.1), split-h from 1 MiB (128 x 4096: 30.1 against gather's 37.8 and split's
39.5; fallback_h200_x4.md). The model puts the crossover at C / L = 41 MiB at 2 ranks and C / (1.5 +
L) = 0.62 MiB at 4 (C = COLLECTIVE_BYTES, L = 1 / GATHER_LOCAL_SHARE), 0.18 MiB at 8 (not
measured). With a residual split never wins: it receives x and the outputs (h among them) where
split-h receives x and h, with the same two collectives; it was the slowest form at 128 rows at 4
ranks, where the constants before this fit (1 MiB per collective, split counted as one) took it.
No multi-node machine yet: over a slower network the bytes weigh more and the crossovers move
down. DISTNORM_NOPEER_FORM=gather|split|split-h forces a form (benchmarks, tests; split-h
without a residual runs split).

Both are chunked so that the receive buffer stays within the workspace's buffer size, and
NOTE [overlapped chunks]: chunk k + 1's collective (all_gather, or all_to_all) is issued before
chunk k is folded, so it crosses the network (NCCL's stream) while chunk k's fold runs (the
compute stream); at most two chunks' receive buffers are alive. Only calls of two or more chunks
outside a CUDA-graph capture overlap; every other call runs its collectives synchronously on its own
stream (an asynchronous one costs two cross-stream events, +3.3 us at M = 1). The fold is a third
to a quarter of the gather form's time at 16384 x 8192 on 2 x H200 by byte count; the overlap is
not yet measured (the benchmark times CUDA graphs). The allreduce_out output and the plain
all-reduce take rowsplit.allreduce_by_slices (the kernel has no T(acc) output).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from distnorm.collectives.plan import NOPEER_FORMS
from distnorm.collectives.rowsplit import (exchange_slices, fold_slices, gather_into_tensor,
                                           linear_spec, scales_to_layout, slice_bounds)
from distnorm.formats import QuantSpec, q_shape, scales_geometry

__all__ = ["allreduce_no_peer", "fold_epilogue", "form_for", "COLLECTIVE_BYTES"]

# a collective's fixed cost in bytes received, and the gather form's local work as a share of
# x's bytes: fitted to the measured crossovers (NOTE [no-peer forms])
COLLECTIVE_BYTES = 960 << 10
GATHER_LOCAL_SHARE = 44
_PACK_ALIGN = 256  # byte alignment of each output's block in the packed buffer (kernel: 16)


def out_row_bytes(spec: Optional[QuantSpec], H: int, dtype: torch.dtype, has_residual: bool,
                  want_y: bool) -> int:
    """Bytes of one row's outputs: residual, y, q codes, scales."""
    n = H * dtype.itemsize * (int(has_residual) + int(want_y))
    if spec is not None and spec.kind != "none":
        n += q_shape(spec, 1, H)[1]  # one byte per code column
        if spec.info.scale_dtype is not None:
            sdtype, per_row = _scales_row(spec, H)
            n += per_row * sdtype.itemsize
    return n


def form_for(M: int, H: int, world: int, esize: int, out_bytes: int, has_residual: bool) -> str:
    """NOTE [no-peer forms]: "gather", "split" or "split-h" for a call of M rows
    (DISTNORM_NOPEER_FORM overrides)."""
    forced = os.environ.get("DISTNORM_NOPEER_FORM", NOPEER_FORMS[0])
    if forced == "split-h" and not has_residual:
        return "split"
    if forced in NOPEER_FORMS[1:]:
        return forced
    x = M * H * esize
    cost = {"gather": COLLECTIVE_BYTES + (world - 1) * x + x // GATHER_LOCAL_SHARE,
            "split": 2 * COLLECTIVE_BYTES + (world - 1) * (x + M * out_bytes) // world}
    if has_residual:
        cost["split-h"] = 2 * COLLECTIVE_BYTES + 2 * (world - 1) * x // world
    return min(cost, key=cost.get)  # dict order: gather first on a tie


def fold_epilogue(parts: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                  spec: Optional[QuantSpec], scale, global_scale, gemma: bool, residual_out, y_out,
                  q_out, scales_out) -> None:
    """h = T(parts[0] + ... + parts[N-1] (float32, in order) + float(residual)), RMSNorm and
    quantization of its rows into the outputs given. parts: [N, M, H] bf16/fp16 (last dim
    contiguous, rows 16-byte aligned); residual and outputs as add_rmsnorm's for M rows, scales in
    spec's layout. CUDA: the single-GPU kernel with N slots; CPU: the reference."""
    from distnorm.ops import _run_reference, run_fused_norm_kernel

    if parts.is_cuda:
        run_fused_norm_kernel(parts, residual, weight, eps, spec, scale, global_scale, gemma,
                              residual_out, y_out, q_out, scales_out)
        return
    rows = parts.shape[1]
    if rows == 0:
        return
    acc = fold_slices(parts, rows)
    h = (acc + residual.float()).to(parts.dtype) if residual is not None else acc.to(parts.dtype)
    if residual_out is not None:
        residual_out.copy_(h)
    _run_reference(h, None, weight, eps, spec, scale, global_scale, gemma, None, y_out, q_out,
                   scales_out)


def _scales_row(spec: QuantSpec, H: int) -> tuple[torch.dtype, int]:
    """(dtype, values per row) of spec's linear row-major scales (what the split form packs)."""
    (_, per_row), _, dtype = scales_geometry(linear_spec(spec), 1, H)
    return dtype, per_row


class PackedRows:
    """One rank's outputs for S rows as blocks of one byte buffer (each block a contiguous
    [S, ...] tensor the kernel writes), gathered with one all_gather and copied out per output."""

    def __init__(self, S: int, fields: list[tuple[str, torch.dtype, int]], device) -> None:
        self.S = S
        self.layout = []  # (name, dtype, elements per row, byte offset)
        off = 0
        for name, dtype, per_row in fields:
            self.layout.append((name, dtype, per_row, off))
            nbytes = S * per_row * dtype.itemsize
            off += -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
        self.total = max(off, _PACK_ALIGN)
        self.buffer = torch.empty(self.total, dtype=torch.uint8, device=device)

    def views(self) -> dict[str, Tensor]:
        """Each output's [S, per_row] block of this rank's buffer."""
        out = {}
        for name, dtype, per_row, off in self.layout:
            size = self.S * per_row * dtype.itemsize
            out[name] = self.buffer[off:off + size].view(dtype).view(self.S, per_row)
        return out

    def gather_into(self, dsts: dict[str, Tensor], M: int, group) -> None:
        """all_gather every rank's buffer, then copy the first M rows (rank order) of each output
        into dsts[name] ([M, per_row] views, any row stride)."""
        import torch.distributed as dist

        world = dist.get_world_size(group)
        recv = torch.empty(world * self.total, dtype=torch.uint8, device=self.buffer.device)
        gather_into_tensor(recv, self.buffer, group=group)
        recv = recv.view(world, self.total)
        S = self.S
        full, rem = divmod(M, S)
        for name, dtype, per_row, off in self.layout:
            size = S * per_row * dtype.itemsize
            src = recv[:, off:off + size].view(dtype).unflatten(1, (S, per_row))
            dst = dsts[name]
            if full:
                dst[:full * S].unflatten(0, (full, S)).copy_(src[:full])
            if rem:
                dst[full * S:M].copy_(src[full, :rem])


def _overlapped(M: int, chunk_rows: int, start, finish, overlap: bool = True) -> None:
    """NOTE [overlapped chunks]: start(a, b, async_op) issues rows [a, b)'s collective and
    returns (its result, its Work, None when not async_op); finish(a, b, result) uses the result
    once the Work is waited on. With overlap and more than one chunk, chunk k + 1 is started
    (asynchronously) before chunk k is finished; otherwise each collective is synchronous, on the
    caller's stream: an asynchronous one runs on NCCL's stream and costs two cross-stream events
    (+3.3 us per call at M = 1 on 2 x H200 in a CUDA graph, benchmarks/results/fallback_h200_x2.md)."""
    chunks = [(a, min(M, a + chunk_rows)) for a in range(0, M, chunk_rows)]
    use_async = overlap and len(chunks) > 1
    pending = start(*chunks[0], use_async) if chunks else None
    for k, (a, b) in enumerate(chunks):
        result, work = pending
        if use_async and k + 1 < len(chunks):
            pending = start(*chunks[k + 1], True)
        if work is not None:
            work.wait()
        finish(a, b, result)
        if not use_async and k + 1 < len(chunks):
            pending = start(*chunks[k + 1], False)


def _overlap_ok(x: Tensor) -> bool:
    """Overlapped chunks outside CUDA-graph capture only: asynchronous collectives inside a
    capture have not been run on GPUs yet (the synchronous order is what tests/multigpu covers)."""
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _gather_form(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                 q_out, scales_out, group, world: int, chunk_rows: int) -> None:
    """NOTE [no-peer forms], gather: per chunk, all_gather x's rows, fold them into the outputs."""
    from distnorm.collectives.dispatch import _rows, _scale_rows

    M, H = x.shape

    def start(a, b, async_op):
        parts = torch.empty(world * (b - a), H, dtype=x.dtype, device=x.device)  # gloo: 2-D
        return parts, gather_into_tensor(parts, x[a:b].contiguous(), group=group,
                                                  async_op=async_op)

    def finish(a, b, parts):
        fold_epilogue(parts.view(world, b - a, H), _rows(residual, a, b), weight, eps, spec, scale,
                      global_scale, gemma, _rows(residual_out, a, b), _rows(y_out, a, b),
                      _rows(q_out, a, b), _scale_rows(spec, scales_out, a, b))

    _overlapped(M, chunk_rows, start, finish, _overlap_ok(x))


def _split_form(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                q_out, scales_out, group, world: int, rank: int, chunk_rows: int) -> None:
    """NOTE [no-peer forms], split: per chunk, all_to_all the row slices, fold this rank's slice
    into a packed buffer, all_gather the buffers into the outputs (scales: row-major linear, then
    spec's layout)."""
    M, H = x.shape
    lin = linear_spec(spec)
    fields = [(name, x.dtype, H) for name, t in (("residual", residual_out), ("y", y_out))
              if t is not None]
    if q_out is not None:
        fields.append(("q", q_out.dtype, q_out.shape[1]))
    scale_dst = None
    if spec is not None and spec.info.scale_dtype is not None:
        sdtype, per_row = _scales_row(spec, H)
        fields.append(("scales", sdtype, per_row))
        scale_dst = (torch.empty(M, per_row, dtype=sdtype, device=x.device)
                     if spec.block_scaled and spec.swizzled else scales_out)
    dsts = {"residual": residual_out, "y": y_out, "q": q_out, "scales": scale_dst}

    def finish(a, b, parts):  # parts: [N, S, H]
        s0, s1 = slice_bounds(b - a, world, rank)
        packed = PackedRows(parts.shape[1], fields, x.device)
        mine = {name: v[:s1 - s0] for name, v in packed.views().items()}
        fold_epilogue(parts[:, :s1 - s0], None if residual is None else residual[a + s0:a + s1],
                      weight, eps, lin, scale, global_scale, gemma, mine.get("residual"),
                      mine.get("y"), mine.get("q"), mine.get("scales"))
        packed.gather_into({name: dsts[name][a:b] for name, *_ in fields}, b - a, group)

    def start(a, b, async_op):
        out = exchange_slices(x[a:b], group, async_op=async_op)
        return out if async_op else (out, None)

    _overlapped(M, chunk_rows, start, finish, _overlap_ok(x))
    if scale_dst is not None and scale_dst is not scales_out:
        scales_to_layout(scale_dst, spec, scales_out)


def _split_h_form(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                  q_out, scales_out, group, world: int, rank: int, chunk_rows: int) -> None:
    """NOTE [no-peer forms], split-h: per chunk, all_to_all the row slices, fold this rank's slice
    into its rows of h, all_gather h (in place in residual_out when the chunk splits evenly), then
    the single-GPU op on the chunk's h rows (no residual) into y / q / scales."""
    from distnorm.collectives.dispatch import _rows, _scale_rows
    from distnorm.ops import _impl as add_rmsnorm_rows

    M, H = x.shape

    def finish(a, b, parts):  # parts: [N, S, H]
        S = parts.shape[1]
        s0, s1 = slice_bounds(b - a, world, rank)
        dst = residual_out[a:b]
        in_place = b - a == world * S and dst.is_contiguous()
        h = dst if in_place else x.new_empty(world * S, H)
        fold_epilogue(parts[:, :s1 - s0], residual[a + s0:a + s1], weight, eps, None, None, None,
                      gemma, h[s0:s1], None, None, None)
        gather_into_tensor(h, h[rank * S:(rank + 1) * S], group=group)
        if not in_place:
            dst.copy_(h[:b - a])
        # the single-GPU op's body (kernel on CUDA, reference on the CPU) on h, no residual
        add_rmsnorm_rows(dst, None, weight, eps, spec, scale, global_scale, gemma, None,
                         _rows(y_out, a, b), _rows(q_out, a, b),
                         _scale_rows(spec, scales_out, a, b))

    def start(a, b, async_op):
        out = exchange_slices(x[a:b], group, async_op=async_op)
        return out if async_op else (out, None)

    _overlapped(M, chunk_rows, start, finish, _overlap_ok(x))


def allreduce_no_peer(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                      spec: Optional[QuantSpec], scale, global_scale, gemma: bool, residual_out,
                      y_out, q_out, scales_out, group, buffer_bytes: int) -> None:
    """allreduce_add_rmsnorm's outputs (checked arguments, allocated outputs, no allreduce_out)
    over torch.distributed in the form form_for picks (NOTE [no-peer forms]), each collective's
    receive buffer within about buffer_bytes."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    M, H = x.shape
    if M == 0:
        return
    # a TP layer's activations require grad; gloo's all_gather (torch 2.11) then refuses its own
    # output views ("A view was created in no_grad mode ..."). The op is not differentiable.
    x = x.detach()
    row = H * x.element_size()
    out_bytes = out_row_bytes(spec, H, x.dtype, residual_out is not None, y_out is not None)
    args = (x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
            scales_out, group, world)
    form = form_for(M, H, world, x.element_size(), out_bytes, residual_out is not None)
    if form == "split":
        _split_form(*args, rank, max(1, buffer_bytes // max(row, out_bytes)))
        return
    chunk = max(1, buffer_bytes // (world * row if form == "gather" else row))
    if chunk < M and spec is not None and spec.block_scaled and spec.swizzled:
        chunk = max(128, chunk // 128 * 128)  # swizzled scales: chunks of whole 128-row tiles
    if form == "gather":
        _gather_form(*args, chunk)
    else:
        _split_h_form(*args, rank, chunk)
