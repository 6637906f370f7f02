"""Host side of the row gather through the peer mappings (kernels/rowgather.py): the
sequence-parallel ops' all-gathers of q, scales and bf16 rows in one launch per chunk of rows,
instead of one torch.distributed all_gather per tensor.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from distnorm.collectives.faults import after_launch, raise_if_failed
from distnorm.collectives.layout import lamport_split, push_half
from distnorm.collectives.rowsplit import row_bytes
from distnorm.kernels.rowgather import MAX_SEGMENTS, THREADS, area_bytes

__all__ = ["gather_by_peers", "copy_unit"]


def copy_unit(bytes_per_row: int) -> Optional[int]:
    """The kernel's copy unit for rows of `bytes_per_row` bytes (16 or 4), None when no unit
    divides them (the caller gathers over torch.distributed)."""
    for unit in (16, 4):
        if bytes_per_row % unit == 0:
            return unit
    return None


def _chunk_rows(world: int, row_sizes: Sequence[int], buffer_bytes: int) -> int:
    """Most rows per shard one launch moves: every segment's [world][rows] area in the lower half
    of the part of the data buffer before the lamport areas (NOTE [push and gather halves])."""
    general = push_half(lamport_split(buffer_bytes)[0])
    rows = general // (world * sum(row_sizes))  # each area takes at least its rows' bytes
    while rows > 0 and sum(area_bytes(world, rows, rb) for rb in row_sizes) > general:
        rows -= 1
    return rows


def gather_by_peers(ws, parts: Sequence[tuple[Tensor, Tensor]], M: int) -> bool:
    """Gather every rank's shard into its rows of the full tensors, on every rank (collective).

    parts: up to three (shard, full): shard [M_r, ...] this rank's rows of M (the row split of
    collectives/rowsplit.py), full a contiguous tensor of at least M rows, the same dtype and row
    shape (a shard may be a view of its own rows of full: gathered in place). Returns False having
    done nothing when the peer path does not apply: no peer mappings, CPU tensors, a row size no
    copy unit divides, a Tuning that asks for torch.distributed (gather_by="nccl"), or a buffer
    that holds no row. The answer depends only on the workspace, shapes and dtypes, so every rank
    gets the same one."""
    from distnorm.collectives.state import state_of

    if not parts or len(parts) > MAX_SEGMENTS or not ws.p2p_ok:
        return False
    state = state_of(ws)
    if state.tuning.gather_by == "nccl" or not all(s.is_cuda and f.is_cuda for s, f in parts):
        return False
    sizes = [math.prod(f.shape[1:]) * f.element_size() for _, f in parts]
    units = [copy_unit(rb) for rb in sizes]
    world, rank = ws.world_size, ws.rank
    S = -(-M // world)
    chunk = min(S, _chunk_rows(world, sizes, ws.buffer_bytes)) if S else 0
    if None in units or (S and chunk < 1):
        return False
    if M == 0:
        return True
    segs = []
    for (shard, full), unit in zip(parts, units):
        if not full.is_contiguous() or full.data_ptr() % unit:
            raise ValueError(f"gather_by_peers: full must be contiguous and {unit}-byte aligned")
        src = row_bytes(shard)  # contiguous bytes (a copy only of an odd view)
        if src.data_ptr() % unit:
            src = src.clone()
        segs.append((src.data_ptr(), full.data_ptr()))
    from distnorm.kernels.compile_allreduce import compiled_rowgather

    form = state.tuning.form("rowgather", M * sum(sizes), world)  # plan's NOTE [sized forms]
    kernel = compiled_rowgather(world, tuple(units), form)
    state.check_signal_pad(ws)
    raise_if_failed(ws)
    sms = torch.cuda.get_device_properties(ws.device).multi_processor_count
    units_per_slice = max(-(-chunk * rb // u) for rb, u in zip(sizes, units))  # of a chunk
    ctas = max(1, min(state.tuning.ctas("rowgather", sms, world), -(-units_per_slice // THREADS)))
    args = []
    for k in range(MAX_SEGMENTS):
        args += [*segs[k], sizes[k]] if k < len(segs) else [0, 0, 16]
    for row0 in range(0, S, chunk):
        kernel(ws.buffer_ptrs, ws.signal_ptrs, ws.error_flag_device, *args, M, S, row0, chunk,
               rank, ctas, state.tuning.timeout_ns)
        state.row_gathers += 1
    after_launch(ws, parts[0][1].device)
    return True
