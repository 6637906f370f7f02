"""The reduce-scatter's x pushes through the TMA, in the pipelined rounds: the form "pipelined-tma"
(NOTE [bulk-copy pushes] in kernels/reducescatter.py says why and what orders what). A part of the
kernel class AllReduceAddRMSNormQuant, like ReduceScatter; the PTX is kernels/bulk.py's.

A round's pushes are, for each of its row groups g and each peer s, the rows
s * S + g * rows_per_cta onward of x (contiguous in x when its rows are) into rows
g * rows_per_cta onward of slot `rank` of peer s's buffer (contiguous there): one bulk copy each
way per (group, peer), through a stage of shared memory that holds the whole round.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.kernels.bulk import (bulk_copy_g2s, bulk_store_s2g, bulk_wait_all,
                                   fence_proxy_async, mbar_arrive_expect_tx, mbar_init)
from distnorm.kernels.ptx import mbarrier_try_wait, smem_ptr_u32

__all__ = ["BULK_FORM", "BULK_MOST_GROUPS", "BULK_SMEM_BYTES", "BULK_SM_BYTES", "BulkPushes",
           "bulk_round_groups", "bulk_smem_bytes"]

BULK_FORM = "pipelined-tma"
# Shared memory per CTA: at most the 48 KiB a kernel gets without opting in to more, and all the
# CTAs the grid cap puts on one SM (compile_allreduce.co_resident_ctas_per_sm: one of 256 threads,
# two of 128, four of 64) at most what two such CTAs take (an H100 / H200 SM has up to 228 KiB):
# the barriers need every CTA of the grid resident at once. The stages get what the epilogue's
# partials, the two mbarriers and their alignment leave of it.
BULK_SMEM_BYTES = 48 << 10
BULK_SM_BYTES = 96 << 10
_SMEM_RESERVED = 2 << 10
# Rounds of at most two row groups: pipelined-g2's rule (at 2 ranks the fastest thread-store rounds
# for packed FP4, within 0.5 % of the best elsewhere; NOTE [reduce-scatter rounds])
BULK_MOST_GROUPS = 2


def bulk_smem_bytes(ctas_per_sm: int) -> int:
    """The shared memory one CTA may take when ctas_per_sm of them share an SM."""
    return min(BULK_SMEM_BYTES, BULK_SM_BYTES // max(1, ctas_per_sm))


def bulk_round_groups(world: int, hidden: int, rows_per_cta: int, ctas_per_sm: int,
                      elem_bytes: int = 2) -> int:
    """Row groups per round of "pipelined-tma" (at most BULK_MOST_GROUPS): as many as one of its two
    stages holds, each group's rows for every peer; 0 when not even one does, or when a row is not
    a whole number of 16-byte units (what a bulk copy moves): then the form pushes with the
    threads' stores in pipelined-g2's rounds."""
    row = hidden * elem_bytes
    if row % 16 or world < 2:
        return 0
    group = (world - 1) * rows_per_cta * row
    return min(BULK_MOST_GROUPS, (bulk_smem_bytes(ctas_per_sm) - _SMEM_RESERVED) // (2 * group))


class BulkPushes:
    """The TMA pushes of AllReduceAddRMSNormQuant (which provides self.t, self.world,
    self.bulk_groups, _push_slices and _unless_failed). `tma` below is _bulk_setup's tuple."""

    def _bulk_sizes(self, dtype) -> tuple:
        """(bytes of a row, of one (group, peer) part of a stage, of a stage)."""
        row = self.t.hidden * (dtype.width // 8)
        part = self.t.rows_per_cta * row
        return row, part, self.bulk_groups * (self.world - 1) * part

    @cute.jit
    def _bulk_setup(self, smem, mX, tidx: Int32):
        """(x_bulk, lead, stages, mbars): whether x's rows are contiguous (else every thread stores
        them, in the same rounds), whether this thread issues the copies (thread 0, x_bulk), and
        the shared addresses of the two stages and their two mbarriers."""
        stage = smem.allocate_tensor(cutlass.Uint8,
                                     cute.make_layout(2 * self._bulk_sizes(mX.element_type)[2]),
                                     byte_alignment=128)
        mbars = smem.allocate_tensor(Int64, cute.make_layout(2), byte_alignment=8)
        x_bulk = Int64(mX.stride[0]) == Int64(self.t.hidden)
        return (x_bulk, (tidx == Int32(0)) & x_bulk, smem_ptr_u32(stage.iterator),
                smem_ptr_u32(mbars.iterator))

    @cute.jit
    def _bulk_round(self, tma, r: Int32, rounds: Int32, failed: Int32, mX, mBuf, rank: Int32,
                    slice_rows: Int32, push_groups: Int32, bidx: Int32, nblk: Int32, step: Int32,
                    row_in_cta: Int32, lane: Int32, rT, dtype: cutlass.Constexpr,
                    may_push: Int32):
        """Round r's x pushes, right after barrier r - 1 (round 0: before the first barrier).
        The lead issues them from stage r % 2 and returns while they drain; it then loads round
        r + 1 into the other stage, which round r - 1's stores left before barrier r - 1."""
        x_bulk, lead, stages, mbars = tma
        g0, end = self._bulk_span(r, bidx, step, push_groups)
        if x_bulk == Int32(0):
            self._push_slices(mX, mBuf, rank, slice_rows, self._unless_failed(failed, end), g0,
                              nblk, row_in_cta, lane, rT, dtype, may_push)
        if lead:
            if r == Int32(0):
                mbar_init(mbars)
                mbar_init(mbars + Int32(8))
                self._bulk_load(mX, stages, mbars, r, g0, end, nblk, rank, slice_rows, dtype)
            self._bulk_store(mX, mBuf, stages, mbars, r, g0, self._unless_failed(failed, end),
                             nblk, rank, slice_rows, dtype, may_push)
            if r + Int32(1) < rounds:
                n0, n1 = self._bulk_span(r + Int32(1), bidx, step, push_groups)
                self._bulk_load(mX, stages, mbars, r + Int32(1), n0, n1, nblk, rank, slice_rows,
                                dtype)

    @cute.jit
    def _bulk_drain(self, tma):
        """Before a barrier: the lead waits until the round's bulk writes are performed, then
        fences the async proxy against the generic one, whose release (the barrier's flags) must
        cover them."""
        if tma[1]:
            bulk_wait_all()
            fence_proxy_async()

    @cute.jit
    def _bulk_span(self, r: Int32, bidx: Int32, step: Int32, push_groups: Int32):
        """(first group, end) of round r: as the pipelined rounds cut them (_rounds' span)."""
        g0 = bidx + r * step
        end = g0 + step
        if end > push_groups:
            end = push_groups
        return g0, end

    @cute.jit
    def _bulk_rows(self, g: Int32, s, slice_rows: Int32, m: Int32) -> Int32:
        """How many rows of shard s's row group g are rows of x (0 to rows_per_cta); s a
        compile-time rank (the rounds' loops over peers) or a run-time one (roles-tma's parts)."""
        i0 = g * Int32(self.t.rows_per_cta)
        n = Int32(self.t.rows_per_cta)
        if slice_rows - i0 < n:
            n = slice_rows - i0
        if m - Int32(s) * slice_rows - i0 < n:
            n = m - Int32(s) * slice_rows - i0
        if n < Int32(0):
            n = Int32(0)
        return n

    @cute.jit
    def _bulk_part(self, stage: Int32, q: Int32, s: cutlass.Constexpr, rank: Int32,
                   part: cutlass.Constexpr) -> Int32:
        """Shared address of the round's q-th group's rows for peer s (the peers other than me in
        rank order) in the stage at `stage`."""
        j = Int32(s)
        if Int32(s) > rank:
            j = Int32(s - 1)
        return stage + (q * Int32(self.world - 1) + j) * Int32(part)

    @cute.jit
    def _bulk_load(self, mX, stages: Int32, mbars: Int32, r: Int32, g0: Int32, end: Int32,
                   nblk: Int32, rank: Int32, slice_rows: Int32, dtype: cutlass.Constexpr):
        """Round r's rows of x (groups g0, g0 + nblk, ... < end, every peer's shard) into stage
        r % 2, counted on its mbarrier: one arrival expecting them all, so the phase cannot
        complete between two of its copies."""
        m = mX.shape[0]
        row, part, stage_bytes = self._bulk_sizes(dtype)
        stage = stages + (r & Int32(1)) * Int32(stage_bytes)
        mbar = mbars + (r & Int32(1)) * Int32(8)
        total = Int32(0)
        for g in range(g0, end, nblk):
            for s in cutlass.range_constexpr(self.world):
                if Int32(s) != rank:
                    total = total + self._bulk_rows(g, s, slice_rows, m) * Int32(row)
        mbar_arrive_expect_tx(mbar, total)
        x0 = mX.iterator.toint()
        for g in range(g0, end, nblk):
            q = (g - g0) // nblk
            for s in cutlass.range_constexpr(self.world):
                n = self._bulk_rows(g, s, slice_rows, m)
                if (Int32(s) != rank) & (n > Int32(0)):
                    first = Int32(s) * slice_rows + g * Int32(self.t.rows_per_cta)  # x's row
                    src = x0 + Int64(first) * Int64(row)
                    bulk_copy_g2s(self._bulk_part(stage, q, s, rank, part), src, n * Int32(row),
                                  mbar)

    @cute.jit
    def _bulk_store(self, mX, mBuf, stages: Int32, mbars: Int32, r: Int32, g0: Int32, end: Int32,
                    nblk: Int32, rank: Int32, slice_rows: Int32, dtype: cutlass.Constexpr,
                    may_push: Int32):
        """Round r's rows from stage r % 2 into slot `rank` of every peer (a bulk group each),
        once the stage's loads have landed (phase r // 2 of its mbarrier; waited for even when
        nothing is stored, end = 0 after a failed barrier or may_push = 0, so that no load is left
        in flight into shared memory when the CTA exits)."""
        m = mX.shape[0]
        row, part, stage_bytes = self._bulk_sizes(dtype)
        stage = stages + (r & Int32(1)) * Int32(stage_bytes)
        ready = Int32(0)
        while ready == Int32(0):
            ready = mbarrier_try_wait(mbars + (r & Int32(1)) * Int32(8), (r >> Int32(1)) & Int32(1))
        # the landed stage (async writes seen through the mbarrier) and the barrier's acquire
        # (generic) before the async proxy's reads and remote writes
        fence_proxy_async()
        if may_push != Int32(0):
            slot = Int64(slice_rows) * Int64(rank) * Int64(row)
            for g in range(g0, end, nblk):
                q = (g - g0) // nblk
                for s in cutlass.range_constexpr(self.world):
                    n = self._bulk_rows(g, s, slice_rows, m)
                    if (Int32(s) != rank) & (n > Int32(0)):
                        dst = mBuf[s] + slot + Int64(g * Int32(self.t.rows_per_cta)) * Int64(row)
                        bulk_store_s2g(dst, self._bulk_part(stage, q, s, rank, part),
                                       n * Int32(row))
