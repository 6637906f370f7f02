"""All-gather of row shards through the peer mappings ("rowgather"): the sequence-parallel ops'
gather of quantized rows, their scales and bf16 rows (collectives/peergather.py is the host side).

Every rank holds its shard of the rows of up to three row-major tensors (segments: q, scales, y; any
dtype, seen as bytes); with S = ceil(M / N) rows per shard, rank r's rows are [r * S, r * S + M_r)
of the full tensors (collectives/rowsplit.py's split). A launch moves rows [row0, row0 + C) of every
shard (C rows: what fits the data buffer; the host loops over chunks):

- phase 1 (push): my chunk's bytes, in units of 16 (or 4) bytes, go to area [rank] of every other
  rank's data buffer and to my own rows of the full output (skipped when the shard sits there:
  gathered in place); cta_barrier;
- phase 2: the other shards' chunks, from areas [s] of my own buffer, into their rows of the full
  output; a final cta_barrier (a peer's next launch may push into my areas as soon as it passed the
  previous barrier, as one-shot's and reduce-scatter's final barriers guard against).

Buffer, per segment k (16-byte aligned, one after the other from offset 0): [N][C] rows of its row
bytes. Unit u of a shard's chunk is moved by CTA (u // THREADS) mod grid on every rank, in both
phases, so every dependency is between same-index CTAs (what cta_barrier orders). The bytes are
copied, never interpreted: the gathered rows are bitwise the shards'.

NOTE [row gather batches]: in the "unit" form (the default) a thread loads one unit, stores it,
then loads the next, so one unit per thread is in flight: about 0.5 MB over an H200's SMs, at
the edge of what the NVLink latency needs (the gather moved 252 GB/s at 16384 x 8192 FP8 on 2 x
H200, benchmarks/results/seqpar_h200_x2.md; two-shot's pushes reach ~390 GB/s, estimated from
its time there). The "batched" form (plan.ROWGATHER_FORMS, a Tuning knob) loads BATCH units of a thread's next BATCH THREADS-unit chunks first (their CTAs are the
same: c, c + grid, ... are all this CTA's), then stores them: BATCH units in flight. A load past
the rows reads unit 0 of the same rows instead (always in bounds) and its stores are skipped.
Same bytes to the same places.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.collectives.layout import (CALL_W_LAST, DEVICE_ERROR_WORD, REGION_ROWGATHER,
                                         region_word)
from distnorm.collectives.plan import ALGORITHM_FORMS
from distnorm.collectives.signature import (GRID_MULTIPLIER, SIGNATURE_MULTIPLIER,
                                            CallDescriptor, signature_constant)
from distnorm.formats import NO_QUANT
from distnorm.kernels.sync import cta_barrier, ld_volatile_sys_u32, st_volatile_sys_v4_u32

__all__ = ["PeerRowGather", "THREADS", "MAX_SEGMENTS", "BATCH", "area_bytes"]

THREADS = 256
MAX_SEGMENTS = 3
BATCH = 4  # NOTE [row gather batches]: units in flight per thread in the "batched" form


def area_bytes(world: int, chunk_rows: int, row_bytes: int) -> int:
    """Bytes of one segment's areas in the data buffer: [world][chunk_rows] rows, 16-aligned."""
    return -(-world * chunk_rows * row_bytes // 16) * 16


class PeerRowGather:
    """Compile-time: world size and each segment's copy unit (16 or 4 bytes: its row bytes and
    addresses are multiples of it). Run-time: the segments' addresses and row bytes, M, S, the
    chunk (row0, C), rank, grid, timeout, the peer tables."""

    def __init__(self, world: int, units: tuple, form: str = ""):
        assert 1 <= len(units) <= MAX_SEGMENTS and all(u in (4, 16) for u in units), units
        forms = ALGORITHM_FORMS["rowgather"]
        form = form or forms[0]
        assert form in forms, form
        self.world = world
        self.units = tuple(units)
        self.batch = BATCH if form == "batched" else 1  # NOTE [row gather batches]
        self.region_word = region_word(REGION_ROWGATHER)
        # NOTE [call descriptor] in kernels/allreduce.py: word 1 carries the units (the row bytes
        # are run-time; the host folds them into M's word through the signature below)
        code = sum((4 if u == 16 else 1) << (3 * k) for k, u in enumerate(self.units))
        self.desc = CallDescriptor(0, code, "rowgather", "bfloat16", NO_QUANT, False, False,
                                   False, False, world, form).words()
        self.sig_const = signature_constant(self.desc)

    @cute.jit
    def __call__(self, mBuf: cute.Tensor, mSig: cute.Tensor, mErr: cute.Tensor, src0: Int64,
                 dst0: Int64, rb0: Int32, src1: Int64, dst1: Int64, rb1: Int32, src2: Int64,
                 dst2: Int64, rb2: Int32, m: Int32, shard: Int32, row0: Int32, crows: Int32,
                 rank: Int32, ctas: Int32, timeout: Int64, stream):
        self.kernel(mBuf, mSig, mErr, src0, dst0, rb0, src1, dst1, rb1, src2, dst2, rb2, m, shard,
                    row0, crows, rank, timeout).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1],
                                                       stream=stream)

    @cute.jit
    def _chunk_rows(self, m: Int32, shard: Int32, row0: Int32, crows: Int32, s: Int32) -> Int32:
        """Rows of shard s in this launch's chunk (0 past the shard's end)."""
        rows = m - s * shard
        if rows > shard:
            rows = shard
        rows = rows - row0
        if rows > crows:
            rows = crows
        if rows < Int32(0):
            rows = Int32(0)
        return rows

    @cute.jit
    def _chunks(self, crows: Int32, rb64: Int64, unit: cutlass.Constexpr) -> Int32:
        """THREADS-unit chunks of one shard's rows of a launch (the same on every rank)."""
        return Int32((Int64(crows) * rb64 // Int64(unit) + Int64(THREADS - 1)) // THREADS)

    @cute.jit
    def _area(self, crows: Int32, rb64: Int64) -> Int64:
        """area_bytes(world, crows, row bytes) at run time."""
        return (Int64(self.world) * Int64(crows) * rb64 + Int64(15)) // Int64(16) * Int64(16)

    @cute.jit
    def _copy_unit(self, src: Int64, dst: Int64, unit: cutlass.Constexpr):
        """`unit` bytes from src to dst (both aligned to it), as int32 words."""
        self._store_unit(self._load_unit(src, unit), dst, unit)

    @cute.jit
    def _load_unit(self, src: Int64, unit: cutlass.Constexpr):
        """`unit` bytes at src (aligned to it) as int32 words in registers."""
        return cute.make_tensor(cute.make_ptr(Int32, src, cute.AddressSpace.gmem,
                                              assumed_align=unit), cute.make_layout(unit // 4)).load()

    @cute.jit
    def _store_unit(self, v, dst: Int64, unit: cutlass.Constexpr):
        cute.make_tensor(cute.make_ptr(Int32, dst, cute.AddressSpace.gmem, assumed_align=unit),
                         cute.make_layout(unit // 4)).store(v)

    def _batch_frags(self, unit: int) -> list:
        """One register fragment of `unit` bytes (int32 words) per unit of a batch, made before
        the loops (NOTE [row gather batches]): the loads fill them, the stores read them."""
        return [cute.make_rmem_tensor(cute.make_layout(unit // 4), Int32)
                for _ in range(self.batch)]

    @cute.jit
    def _load_batch(self, frags: list, src: Int64, units: Int32, c0: Int32, nblk: Int32,
                    tidx: Int32, unit: cutlass.Constexpr):
        """frags[j] <- this thread's unit of THREADS-unit chunk c0 + j * nblk of src; a unit at or
        past `units` loads unit 0 instead (in bounds; the caller skips its store)."""
        for j in cutlass.range_constexpr(self.batch):
            u = (c0 + Int32(j) * nblk) * Int32(THREADS) + tidx
            if u >= units:
                u = Int32(0)
            frags[j].store(self._load_unit(src + Int64(u) * Int64(unit), unit))

    @cute.jit
    def _push_batched(self, mBuf, rank: Int32, my_src: Int64, my_dst: Int64, area: Int64,
                      units_mine: Int32, chunks: Int32, bidx: Int32, nblk: Int32, tidx: Int32,
                      unit: cutlass.Constexpr):
        """Phase 1 of one segment in the "batched" form (NOTE [row gather batches])."""
        frags = self._batch_frags(unit)
        end = chunks
        if units_mine == Int32(0):
            end = Int32(0)  # no row of mine in this chunk: nothing to load, not even unit 0
        for c0 in range(bidx, end, nblk * Int32(self.batch)):
            self._load_batch(frags, my_src, units_mine, c0, nblk, tidx, unit)
            for j in cutlass.range_constexpr(self.batch):
                u = (c0 + Int32(j) * nblk) * Int32(THREADS) + tidx
                if u < units_mine:
                    off = Int64(u) * Int64(unit)
                    if my_src != my_dst:
                        self._store_unit(frags[j].load(), my_dst + off, unit)
                    for s in cutlass.range_constexpr(self.world):
                        if Int32(s) != rank:
                            self._store_unit(frags[j].load(), mBuf[s] + area + off, unit)

    @cute.jit
    def _copy_out_batched(self, own: Int64, base: Int64, dst: Int64, rb64: Int64, m: Int32,
                          shard: Int32, row0: Int32, crows: Int32, rank: Int32, chunks: Int32,
                          bidx: Int32, nblk: Int32, tidx: Int32, unit: cutlass.Constexpr):
        """Phase 2 of one segment in the "batched" form: the other shards' rows out of my areas
        (a load past a shard's rows reads unit 0 of its area: in the buffer whatever the rows)."""
        frags = self._batch_frags(unit)
        for c0 in range(bidx, chunks, nblk * Int32(self.batch)):
            for s in cutlass.range_constexpr(self.world):
                if Int32(s) != rank:
                    units_s = Int32(Int64(self._chunk_rows(m, shard, row0, crows, Int32(s))) * rb64
                                    // Int64(unit))
                    src = own + base + Int64(s) * Int64(crows) * rb64
                    self._load_batch(frags, src, units_s, c0, nblk, tidx, unit)
                    for j in cutlass.range_constexpr(self.batch):
                        u = (c0 + Int32(j) * nblk) * Int32(THREADS) + tidx
                        if u < units_s:
                            self._store_unit(frags[j].load(), dst + (Int64(s) * Int64(shard)
                                             + Int64(row0)) * rb64 + Int64(u) * Int64(unit), unit)

    @cute.kernel
    def kernel(self, mBuf: cute.Tensor, mSig: cute.Tensor, mErr: cute.Tensor, src0: Int64,
               dst0: Int64, rb0: Int32, src1: Int64, dst1: Int64, rb1: Int32, src2: Int64,
               dst2: Int64, rb2: Int32, m: Int32, shard: Int32, row0: Int32, crows: Int32,
               rank: Int32, timeout: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        segs = [(src0, dst0, rb0), (src1, dst1, rb1), (src2, dst2, rb2)]
        if (tidx == 0) & (bidx == 0):
            st_volatile_sys_v4_u32(mSig[rank] + Int64(CALL_W_LAST * 4), m, Int32(self.desc[1]),
                                   Int32(self.desc[2]), Int32(self.desc[3]))
        sig = ((m * Int32(SIGNATURE_MULTIPLIER)) ^ Int32(self.sig_const)) + Int32(nblk) * Int32(
            GRID_MULTIPLIER) + (rb0 + rb1 * Int32(3) + rb2 * Int32(5)) * Int32(SIGNATURE_MULTIPLIER)
        # NOTE [a failed rank arrives nowhere] (kernels/sync.py): no push after an earlier failure
        healthy = Int32(1)
        if ld_volatile_sys_u32(mSig[rank] + Int64(DEVICE_ERROR_WORD * 4)) != Int32(0):
            healthy = Int32(0)
        mine = self._chunk_rows(m, shard, row0, crows, rank)
        base = Int64(0)
        for k in cutlass.range_constexpr(len(self.units)):
            src, dst, rb = segs[k]
            unit = self.units[k]
            rb64 = Int64(rb)
            units_mine = Int32(Int64(mine) * rb64 // Int64(unit))
            chunks = self._chunks(crows, rb64, unit)
            area = base + Int64(rank) * Int64(crows) * rb64
            my_src = src + Int64(row0) * rb64
            my_dst = dst + (Int64(rank) * Int64(shard) + Int64(row0)) * rb64
            if healthy == Int32(0):
                chunks = Int32(0)
            if const_expr(self.batch > 1):
                self._push_batched(mBuf, rank, my_src, my_dst, area, units_mine, chunks, bidx,
                                   nblk, tidx, unit)
            else:
                for c in range(bidx, chunks, nblk):
                    u = c * Int32(THREADS) + tidx
                    if u < units_mine:
                        off = Int64(u) * Int64(unit)
                        if my_src != my_dst:
                            self._copy_unit(my_src + off, my_dst + off, unit)
                        for s in cutlass.range_constexpr(self.world):
                            if Int32(s) != rank:
                                self._copy_unit(my_src + off, mBuf[s] + area + off, unit)
            base = base + self._area(crows, rb64)
        failed = cta_barrier(mSig, rank, self.world, self.region_word, bidx, timeout, mErr, sig)

        own = mBuf[rank]
        base = Int64(0)
        for k in cutlass.range_constexpr(len(self.units)):
            src, dst, rb = segs[k]
            unit = self.units[k]
            rb64 = Int64(rb)
            chunks = self._chunks(crows, rb64, unit)
            if failed != Int32(0):
                chunks = Int32(0)
            if const_expr(self.batch > 1):
                self._copy_out_batched(own, base, dst, rb64, m, shard, row0, crows, rank, chunks,
                                       bidx, nblk, tidx, unit)
            else:
                for c in range(bidx, chunks, nblk):
                    u = c * Int32(THREADS) + tidx
                    off = Int64(u) * Int64(unit)
                    for s in cutlass.range_constexpr(self.world):
                        if Int32(s) != rank:
                            rows_s = self._chunk_rows(m, shard, row0, crows, Int32(s))
                            if u < Int32(Int64(rows_s) * rb64 // Int64(unit)):
                                self._copy_unit(
                                    own + base + Int64(s) * Int64(crows) * rb64 + off,
                                    dst + (Int64(s) * Int64(shard) + Int64(row0)) * rb64 + off,
                                    unit)
            base = base + self._area(crows, rb64)
        # nobody may push into my areas (next launch) while I still read them
        cta_barrier(mSig, rank, self.world, self.region_word, bidx, timeout, mErr, sig)
