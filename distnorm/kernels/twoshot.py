"""The two-shot all-reduce ("twoshot"): its body ``TwoShot._twoshot``, a part of the kernel class
``AllReduceAddRMSNormQuant`` (kernels/allreduce.py, whose helpers it uses: _sum_slots,
_fragments, _barrier, _row_view, _may_push, ...; NOTE [programmatic dependent launch] and the
barrier coverage argument are there). Its push (_push_slices) is also the sequence-parallel
reduce-scatter's phase 1 (kernels/reducescatter.py).

"twoshot" (bandwidth): rows are cut into N contiguous slices of S = ceil(rows / N) rows; slice s
is owned by rank s. Phase 1 (reduce-scatter push): x rows of slice s go to slot `rank` of rank s's
scatter area (own slice: stays in x); cta_barrier. Phase 2: each rank reduces its own slice
(float32, rank order) and does the residual add there (the residual is replicated, so the owner
has it): it pushes T(h) (2 bytes per element) -- and T(acc) when the plain all-reduce output is
asked for together with a residual -- into the gather area of every other rank, and runs its own
slice's epilogue right there (its HBM traffic overlaps the NVLink pushes); cta_barrier. Phase 3:
every rank reads the other slices' full rows of gathered h from its local buffer, writes
residual_out and runs the epilogue. Gathering T(h)
instead of T(acc) keeps h = T(acc + float(res)) exact (one rounding of the float32 sum) and
bitwise identical on all ranks. No third barrier (NOTE [two-shot final barrier]).
Buffer: scatter [N][S][H] T in the lower half; gather h [N*S][H] T, then (optional) gather acc
[N*S][H] T in the upper half (table entries N + s; NOTE [push and gather halves] in
collectives/layout.py).

NOTE [two-shot forms]: `form` (plan.TWOSHOT_FORMS, a Tuning knob: same bits, other traffic)
chooses who moves the rows over NVLink. "push" is the above (remote stores in both exchanges).
"pull-gather": phase 2 writes T(h) (and T(acc)) of my slice into MY gather area only, and phase 3
loads the other slices' rows from their owners' gather areas (remote loads; nothing pushed).
"pull": in addition phase 1 only copies my x rows of the other slices into my own buffer (row
`row` of the scatter area, which has N*S rows: local HBM traffic), and phase 2 loads row
rank*S+i of every peer's copy (all N-1 remote loads in flight, summed in rank order as before).
Every dependency stays between same-index CTAs (the copy loop walks the push loop's rows), the
barriers stay two, and the float32 operations are the same, so the bits are.

NOTE [wide two-shot]: "push-wide" and "pull-wide" move what "push" and "pull" move from a grid
world times as wide: CTA b works on slice j = b // G only (G = grid / world, row groups b % G,
b % G + G, ...). Phase 1: it moves slice j's rows (none when j is mine); phase 2: only the CTAs
of my own slice reduce and finish its rows; phase 3: the CTAs of the other slices finish those.
With one CTA per row group of every slice, a CTA's serial work at small M is one row move and
one row's reduce or epilogue, where the default grid has every CTA move N - 1 rows and finish N
(on 4 x H200 the fused two-shot at 128 x 4096 ran 16 CTAs: 16.6 us against torch's two-shot
all-reduce alone at 14.2, benchmarks/results/allreduce_fusion_fi_h200_x4.md). Coverage holds
as before: the row group g of slice j is moved by every rank's CTA b = j * G + g % G, reduced by
its owner's (rank j's) CTA b after barrier 1 (which pairs the CTAs b), and read in phase 3 by
every rank's CTA b after barrier 2. The same float32 operations per row: the same bits.

NOTE [two-shot final barrier]
Why two-shot has no third barrier (one-shot and reduce-scatter keep theirs). After barrier 2 a rank
reads only gathered rows: in its own gather area, or in the pull forms its peers'. What could
overwrite them before it is done:
- a peer's next call, which starts once the peer's grid has ended (that needs only our arrival at
  barrier 2, not the end of our phase 3): before its first barrier it writes our buffer only in
  the lower half (pushed slots; collectives/layout.py NOTE [push and gather halves]), and the
  gather areas are in the upper half; after that barrier (which needs our flag, written by our
  next kernel, after this one ended: stream order, NOTE [programmatic dependent launch]) anything;
- our own next call: after this kernel ended, by stream order.
And what phase 2 reads (our scatter area, or in the pull form our peers' copies of x) is read
before barrier 2, which every peer's grid passed before its next call started; the pull form's
copy into our own lower half comes from our next kernel, after all of this one's CTAs passed
barrier 2, i.e. after every peer's same-index CTA had finished its loads. Until 2026-11-27 the
gather areas sat right after the scatter slots, where a larger next call's pushes reach, and a
third barrier kept them safe. Dropping it took 14-20% off every two-shot call at 1-128 rows on 4 x
H200 (fused FP8 1 x 4096 11.5 -> 9.7 us), 4-7% at 512 rows, 1-3% from 2048; at 2 ranks nothing
measurable (benchmarks/results/branches_ab_h200_x4.md, branches_ab_h200_x2.md).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.formats import VEC
from distnorm.kernels.tiling import RowTiling

__all__ = ["TwoShot", "slice_batch", "SLICE_BATCH_VECS", "TS_ROUNDS"]


# NOTE [slice batches]
# Two-shot's phase 1 (a row of every other slice: load from x, store to its owner or to my copy) and
# phase 3 (a gathered row of every other slice, then its epilogue) visit the N-1 other slices one
# after another. Issued one slice at a time, each slice's load waits for the previous slice's
# stores (the compiler cannot tell x from the peer buffers) or epilogue, so a CTA pays N-1 load
# latencies per row group, NVLink latencies in the pull forms. Slices therefore go in batches: the
# batch's loads first, then its stores / epilogues, SLICE_BATCH_VECS vectors in flight per thread
# (a batch is one slice at world 2, which keeps that kernel as it was).
SLICE_BATCH_VECS = 16

# NOTE [two-shot rounds]
# The "-rounds" forms (push-rounds, pull-rounds) cut a CTA's row groups into up to TS_ROUNDS rounds
# and push round r + 1's rows before reducing round r: iteration r is [push x of round r + 1]
# [phase 2 of round r, its h pushed] [barrier] [phase 3 of round r], after a first [push x of round
# 0] [barrier]. So x rows cross the link while earlier rows are reduced and finished, where the
# one-round forms leave the link idle during phase 3 (at 8192 x 8192 on 4 ranks about 250 MB of
# local traffic per rank, ~70 us of the 650 measured). One barrier per round serves both
# exchanges: it follows the pushes of round r + 1 and the h of round r in every rank's program
# order, so after it phase 2 of round r + 1 and phase 3 of round r read only rows that landed;
# each round's rows are other rows, written once. With one round this is exactly the one-round
# form (two barriers). The last round's phase 3 reads gathered rows as before, so NOTE [two-shot
# final barrier] holds unchanged; every rank's same-index CTA has the same groups, hence the same
# rounds and barriers; the float32 operations per row are the same, so are the bits.
TS_ROUNDS = 4


def slice_batch(world: int, tiling: RowTiling) -> int:
    """Slices per batch (NOTE [slice batches])."""
    return 1 if world <= 2 else max(1, SLICE_BATCH_VECS // tiling.vecs_per_thread)


class TwoShot:
    """The two-shot algorithm of AllReduceAddRMSNormQuant (which provides self.t, self.core,
    self.world, self.slice_batch, self.pull_scatter, self.pull_gather, self.gather_acc and the
    helpers named in the module docstring)."""

    def _slice_frags(self, rT) -> list:
        """One register fragment per slice of a batch (NOTE [slice batches]), rT the first."""
        return [rT] + [self.core.zeros(rT.element_type) for _ in range(self.slice_batch - 1)]

    @cute.jit
    def _other_row(self, s: cutlass.Constexpr, i: Int32, slice_rows: Int32, m: Int32,
                   rank: Int32, only=None):
        """(row i of slice s, whether it is a row of x and not of my own slice -- and, with
        `only`, of slice `only`): the rows this rank moves for another slice's owner."""
        row = s * slice_rows + i
        moved = (i < slice_rows) & (row < m) & (Int32(s) != rank)
        if const_expr(only is not None):
            moved = moved & (Int32(s) == only)
        return row, moved

    @cute.jit
    def _rounds(self, first: Int32, step: Int32, groups: Int32, most: cutlass.Constexpr):
        """(rounds, span, end of round 0) of a CTA's row groups first, first + step, ... < groups
        cut into at most `most` rounds of `span` (a multiple of step) in g, or with most < 0 into
        rounds of at most -most groups (NOTE [two-shot rounds], NOTE [reduce-scatter rounds])."""
        mine = Int32(0)  # my groups: g = first + k * step, k < mine
        if first < groups:
            mine = (groups - first + step - 1) // step
        rounds = mine
        if const_expr(most > 0):
            if rounds > Int32(most):
                rounds = Int32(most)
        else:
            rounds = (mine + Int32(-most - 1)) // Int32(-most)
        if rounds < Int32(1):
            rounds = Int32(1)
        span = (mine + rounds - 1) // rounds * step
        end = first + span
        if end > groups:
            end = groups
        return rounds, span, end

    @cute.jit
    def _push_slices(self, mX, mBuf, rank: Int32, slice_rows: Int32, push_groups: Int32,
                     bidx: Int32, nblk: Int32, row_in_cta: Int32, lane: Int32, rT,
                     dtype: cutlass.Constexpr, may_push: Int32, only=None):
        """Reduce-scatter push: row i of slice s -> rank s, slot `rank`, row i (S = slice_rows
        rows per slot, push_groups >= ceil(S / rows_per_cta) row groups); my own slice stays in x.
        Rows are loaded in any case, stored only when may_push != 0 (NOTE [push guard]).
        With `only` (a wide two-shot's slice, NOTE [wide two-shot]) the rows of that slice alone;
        bidx, nblk are then the first group and the stride of the CTA's groups.
        The "pull" two-shot (NOTE [two-shot forms]) copies row s*S+i to row s*S+i of my own buffer
        instead, for its owner to load."""
        t = self.t
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        slot_elems = Int64(slice_rows) * hidden
        mine = Int64(0)
        if const_expr(self.pull_scatter):
            mine = mBuf[rank]  # read once: the stores below may alias the table for all it knows
        frags = self._slice_frags(rT)
        for g in range(bidx, push_groups, nblk):
            i = g * t.rows_per_cta + row_in_cta
            for b0 in cutlass.range_constexpr(0, self.world, self.slice_batch):  # NOTE [slice batches]
                for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                    row, moved = self._other_row(s, i, slice_rows, m, rank, only)
                    if moved:
                        self.core.load_row(frags[s - b0], cute.zipped_divide(mX[row, None], (VEC,)),
                                           lane)
                for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                    row, moved = self._other_row(s, i, slice_rows, m, rank, only)
                    if moved & (may_push != Int32(0)):
                        if const_expr(self.pull_scatter):
                            self.core.store_row(frags[s - b0], self._row_view(
                                mine, Int64(row) * hidden, dtype), lane, dtype)
                        else:
                            off = slot_elems * Int64(rank) + Int64(i) * hidden
                            self.core.store_row(frags[s - b0], self._row_view(mBuf[s], off, dtype),
                                                lane, dtype)

    @cute.jit
    def _gather_row(self, rH, rA, dst: Int64, gather_h: Int64, gather_a: Int64, row: Int32,
                    lane: Int32, dtype: cutlass.Constexpr):
        """Row `row` of T(h) (and of T(acc) when gathered) into the gather areas of buffer `dst`."""
        off = Int64(row) * Int64(self.t.hidden)
        self.core.store_row(rH, self._row_view(dst, gather_h + off, dtype), lane, dtype)
        if const_expr(self.gather_acc):
            self.core.store_row(rA, self._row_view(dst, gather_a + off, dtype), lane, dtype)

    @cute.jit
    def _twoshot(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                 rank: Int32, eps: Float32, timeout: Int64, rows: Int32, slice_rows: Int32,
                 groups: Int32, own_pad: Int64):
        t = self.t
        dtype = mX.element_type
        _, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        slot_elems = Int64(slice_rows) * hidden        # one scatter slot: S rows
        # the gather areas, in the upper half (table entries world + s: NOTE [push and gather
        # halves]): h of N*S rows, then T(acc) (when asked)
        gather_h = Int64(0)
        gather_a = slot_elems * self.world

        bufs, rT, rR, rH, static_scale, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane)
        rA = self.core.zeros(Float32)
        may_push = self._may_push(own_pad)
        sig = self._describe_launch(own_pad, m)
        first, step, only = bidx, nblk, None  # my row groups: first, first + step, ...
        if const_expr(self.wide):  # NOTE [wide two-shot]: and only slice `only`'s rows
            step = nblk // self.world
            only = bidx // step
            first = bidx - only * step

        # phase 1 (reduce-scatter push); my own slice stays in x (phase 2 reads it there)
        if const_expr(self.ts_rounds == 1):
            self._push_slices(mX, mBuf, rank, slice_rows, groups, first, step, row_in_cta, lane,
                              rT, dtype, may_push, only)
            failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)
            self._twoshot_round(first, groups, step, failed, only, mX, mR, mRout, mW, mY, mQ, mS,
                                mAR, mBuf, mSig, mErr, rank, eps, timeout, rows, slice_rows, sig,
                                bidx, row_in_cta, lane, bufs, rT, rR, rH, rA, static_scale,
                                global_scale, rW, dtype, hidden, slot_elems, gather_h,
                                gather_a)
        else:
            # NOTE [two-shot rounds]: my groups cut into rounds of `span` (in g), the next round's
            # rows pushed before this round is reduced and finished
            rounds, span, end = self._rounds(first, step, groups, self.ts_rounds)
            self._push_slices(mX, mBuf, rank, slice_rows, end, first, step, row_in_cta, lane, rT,
                              dtype, may_push, only)
            failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)
            for r in range(rounds):
                g0 = first + r * span
                end = g0 + span
                if end > groups:
                    end = groups
                if r + 1 < rounds:
                    nxt = end + span
                    if nxt > groups:
                        nxt = groups
                    self._push_slices(mX, mBuf, rank, slice_rows, self._unless_failed(failed, nxt),
                                      end, step, row_in_cta, lane, rT, dtype, may_push, only)
                failed = self._twoshot_round(g0, end, step, failed, only, mX, mR, mRout, mW, mY,
                                             mQ, mS, mAR, mBuf, mSig, mErr, rank, eps, timeout,
                                             rows, slice_rows, sig, bidx, row_in_cta, lane, bufs,
                                             rT, rR, rH, rA, static_scale, global_scale, rW, dtype,
                                             hidden, slot_elems, gather_h, gather_a)
        # no third barrier: NOTE [two-shot final barrier]

    @cute.jit
    def _twoshot_round(self, g0: Int32, g1: Int32, step: Int32, failed: Int32, only, mX, mR,
                       mRout, mW, mY, mQ, mS, mAR, mBuf, mSig, mErr, rank: Int32, eps: Float32,
                       timeout: Int64, rows: Int32, slice_rows: Int32, sig: Int32, bidx: Int32,
                       row_in_cta: Int32, lane: Int32, bufs, rT, rR, rH, rA, static_scale,
                       global_scale, rW, dtype: cutlass.Constexpr, hidden: Int64,
                       slot_elems: Int64, gather_h: Int64, gather_a: Int64) -> Int32:
        """Two-shot phases 2 and 3 for my row groups g0, g0 + step, ... < g1 (all of them, or one
        round's: NOTE [two-shot rounds]), the barrier between them included; returns `failed`
        with that barrier's outcome. hidden, slot_elems (one scatter slot's elements), gather_h /
        gather_a (the gather areas' element offsets) as _twoshot computes them."""
        t = self.t
        m = mX.shape[0]
        # phase 2: reduce my slice, residual add, push T(h) (and T(acc)) to the other ranks' gather
        # areas, then finish my slice's rows here: their epilogue overlaps the NVLink traffic
        # instead of re-reading h in phase 3
        base = mBuf[rank]
        gbase = mBuf[self.world + rank]
        mine = self._unless_failed(failed, g1)
        if const_expr(self.wide):
            if only != rank:  # another slice's CTA: nothing to reduce here
                mine = Int32(0)
        for g in range(g0, mine, step):
            i = g * t.rows_per_cta + row_in_cta
            row = rank * slice_rows + i
            row_valid = (i < slice_rows) & (row < m)
            rH.fill(0.0)
            if row_valid:
                if const_expr(self.pull_scatter):
                    self._sum_slots(rH, rT, base, slot_elems, Int64(row) * hidden,
                                    self._row_addr(mX, row), rank, lane, mBuf)
                else:
                    self._sum_slots(rH, rT, base, slot_elems, Int64(i) * hidden,
                                    self._row_addr(mX, row), rank, lane)
                if const_expr(self.gather_acc):
                    rA.store(rH.load())
                if const_expr(self.has_residual):
                    self.core.load_row(rR, cute.zipped_divide(mR[row, None], (VEC,)), lane)
                self.core.round_sum(rH, rR, self.has_residual, dtype)
                if const_expr(self.pull_gather):  # my gather area, for the peers to load
                    self._gather_row(rH, rA, gbase, gather_h, gather_a, row, lane, dtype)
                else:
                    for s in cutlass.range_constexpr(self.world):
                        if Int32(s) != rank:
                            self._gather_row(rH, rA, mBuf[self.world + s], gather_h, gather_a,
                                             row, lane, dtype)
                if const_expr(self.has_residual):
                    self.core.store_row(rH, cute.zipped_divide(mRout[row, None], (VEC,)), lane, dtype)
                if const_expr(self.write_allreduce):
                    src = rH
                    if const_expr(self.gather_acc):
                        src = rA
                    self.core.store_row(src, cute.zipped_divide(mAR[row, None], (VEC,)), lane, dtype)
            self.core.epilogue(rH, row, row_valid, (i < slice_rows) & (row < rows), lane,
                               row_in_cta, eps, mW, mY, mQ, mS, static_scale,
                               global_scale, bufs, rW)
            cute.arch.barrier()  # shared-memory partials are reused by the next row
        failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig) | failed

        # phase 3: the other ranks' slices: full rows of gathered h -> residual_out, allreduce_out,
        # epilogue
        gathered = self._slice_frags(rT)
        others = self._unless_failed(failed, g1)
        if const_expr(self.wide):
            if only == rank:  # my own slice's CTA: finished in phase 2
                others = Int32(0)
        for g in range(g0, others, step):
            i = g * t.rows_per_cta + row_in_cta
            for b0 in cutlass.range_constexpr(0, self.world, self.slice_batch):  # NOTE [slice batches]
                if const_expr(self.slice_batch > 1):  # the batch's loads first
                    for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                        row, moved = self._other_row(s, i, slice_rows, m, rank, only)
                        if moved:
                            self.core.load_row(gathered[s - b0], self._row_view(
                                self._gather_source(gbase, mBuf, s), gather_h + Int64(row) * hidden,
                                dtype), lane)
                for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                    self._gathered_row(gathered[s - b0], rT, rH, s, i, rank, slice_rows, m, rows,
                                       gbase, gather_h, gather_a, mBuf, mAR, mRout, mW, mY, mQ, mS,
                                       lane, row_in_cta, eps, static_scale, global_scale, bufs, rW,
                                       dtype, only)
        return failed

    @cute.jit
    def _gather_source(self, gbase: Int64, mBuf, s: cutlass.Constexpr) -> Int64:
        """Whose gather area holds slice s's gathered rows: mine (gbase), or in the pull forms its
        owner's (NOTE [two-shot forms]; table entry world + s: NOTE [push and gather halves])."""
        src = gbase
        if const_expr(self.pull_gather):
            src = mBuf[self.world + s]
        return src

    @cute.jit
    def _gathered_row(self, rG, rT, rH, s: cutlass.Constexpr, i: Int32, rank: Int32,
                      slice_rows: Int32, m: Int32, rows: Int32, gbase: Int64, gather_h: Int64,
                      gather_a: Int64, mBuf, mAR, mRout, mW, mY, mQ, mS, lane: Int32,
                      row_in_cta: Int32, eps: Float32, static_scale, global_scale, bufs, rW,
                      dtype: cutlass.Constexpr, only=None):
        """Two-shot phase 3 for row i of slice s: its gathered T(h) (in rG when batches loaded it,
        NOTE [slice batches]; loaded here into rT otherwise) -> residual_out, allreduce_out,
        epilogue. Nothing for my own slice, nor with `only` (NOTE [wide two-shot]) for a slice
        other than that (uniform over the CTA: the epilogue's barriers stay matched)."""
        hidden = Int64(self.t.hidden)
        other = Int32(s) != rank
        if const_expr(only is not None):
            other = other & (Int32(s) == only)
        if other:
            row = s * slice_rows + i
            row_valid = (i < slice_rows) & (row < m)
            rH.fill(0.0)
            src = self._gather_source(gbase, mBuf, s)
            if row_valid:
                if const_expr(self.slice_batch > 1):
                    rT.store(rG.load())
                else:
                    self.core.load_row(rT, self._row_view(src, gather_h + Int64(row) * hidden,
                                                          dtype), lane)
                rH.store(rT.load().to(Float32))
                if const_expr(self.has_residual):
                    self.core.store_row(rH, cute.zipped_divide(mRout[row, None], (VEC,)), lane,
                                        dtype)
                if const_expr(self.write_allreduce):
                    if const_expr(self.gather_acc):
                        self.core.load_row(rT, self._row_view(src, gather_a + Int64(row) * hidden,
                                                              dtype), lane)
                    self.core.store_row(rT, cute.zipped_divide(mAR[row, None], (VEC,)), lane,
                                        dtype)
            self.core.epilogue(rH, row, row_valid, (i < slice_rows) & (row < rows), lane,
                               row_in_cta, eps, mW, mY, mQ, mS, static_scale, global_scale, bufs,
                               rW)
            cute.arch.barrier()  # shared-memory partials are reused by the next row
