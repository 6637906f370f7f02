"""Fused all-reduce + [residual add] + RMSNorm + [quantization] over peer-mapped buffers (NVLink P2P).

One kernel class, three compile-time algorithms:

- "oneshot" (latency): CTA b owns row groups g = b, b + grid, ... (rows_per_cta rows each, the
  thread -> row mapping of fused_norm.py). Phase 1 pushes this rank's x rows into slot `rank` of
  every OTHER rank's data buffer (128-bit stores through the peer mappings); cta_barrier; phase 2
  reads slots 0..N-1 of the local buffer (its own slot from x: a rank never sends to itself), sums
  them in float32 in rank order 0..N-1, h = T(acc + res),
  writes residual_out (and T(acc) when asked), then the shared NormQuantCore epilogue; a final
  cta_barrier so that no rank's next call overwrites a slot a peer is still reading.
  Buffer: [N slots][rows][H] of T (rows = M, or M padded to 128 for swizzled scales).

- "twoshot" (bandwidth): rows are cut into N contiguous slices of S = ceil(rows / N) rows; slice s
  is owned by rank s. Phase 1 (reduce-scatter push): x rows of slice s go to slot `rank` of rank s's
  scatter area (own slice: stays in x); cta_barrier. Phase 2: each rank reduces its own slice
  (float32, rank order) and does the residual add there (the residual is replicated, so the owner
  has it): it pushes T(h) (2 bytes per element) -- and T(acc) when the plain all-reduce output is
  asked for together with a residual -- into the gather area of every other rank, and runs its own
  slice's epilogue right there (its HBM traffic overlaps the NVLink pushes); cta_barrier. Phase 3:
  every rank reads the other slices' full rows of gathered h from its local buffer, writes
  residual_out and runs the epilogue. Gathering T(h)
  instead of T(acc) keeps h = T(acc + float(res)) exact (one rounding of the float32 sum) and
  bitwise identical on all ranks. Final cta_barrier as in one-shot (NOTE [two-shot final barrier]).
  Buffer: scatter [N][S][H] T, then gather h [N*S][H] T, then (optional) gather acc [N*S][H] T.
  NOTE [two-shot forms]: `form` (plan.TWOSHOT_FORMS, a Tuning knob: same bits, other traffic)
  chooses who moves the rows over NVLink. "push" is the above (remote stores in both exchanges).
  "pull-gather": phase 2 writes T(h) (and T(acc)) of my slice into MY gather area only, and phase 3
  loads the other slices' rows from their owners' gather areas (remote loads; nothing pushed).
  "pull": in addition phase 1 only copies my x rows of the other slices into my own buffer (row
  `row` of the scatter area, which has N*S rows: local HBM traffic), and phase 2 loads row
  rank*S+i of every peer's copy (all N-1 remote loads in flight, summed in rank order as before).
  Every dependency stays between same-index CTAs (the copy loop walks the push loop's rows), the
  barriers stay three (the final one as in NOTE [two-shot final barrier]: a peer may still load my
  gather area when my next call starts), and the float32 operations are the same, so the bits are.

- "reducescatter" (the sequence-parallel op, collectives/seqpar.py): two-shot's phase 1 over
  slices of S = ceil(M / N) unpadded rows, then phase 2 for my slice only, writing shard-local
  outputs (rows 0..M_r-1 of residual_out, y, q, scales; scale padding to 128 rows of the shard);
  final cta_barrier. Buffer: scatter [N][S][H] T.

- "lamport" (latency, no barrier): one-shot whose readers poll the data itself. Three rotating
  areas (collectives/layout.py; sentinel: kernels/lamport.py); call c pushes its sanitized rows into area c mod 3,
  slot `rank`, of every other rank with 128-bit volatile stores, polls its local area until no word
  of the peers' slots is the sentinel (the residual and weight loads are issued before the polls),
  sums in rank order as one-shot (own rows from x), and refills the peers' slots of the previous
  call's area with the sentinel (the own slot is never written and stays sentinel).
  The area index lives in the signal pad (NOTE [lamport call state], NOTE [lamport clearing] in
  kernels/lamport.py).
  The buffer-pointer table has LAMPORT_AREAS * N entries: entry k * N + s = rank s's area k.

NOTE [two-shot final barrier]
What two-shot's last cta_barrier guards (and what a change that drops it must keep safe): phase 3
reads this rank's gather area, and the NEXT call's first writes into this rank's buffer come from
peers before that call's first barrier -- one-shot's and two-shot's row pushes into the slots /
scatter area at the start of the buffer, reduce-scatter's likewise. A peer starts its next call
as soon as its own grid finished, which needs only our arrival at barrier 2, not the end of our
phase 3. When the next call's pushes reach past the start of our gather area (N * S_next > N * S:
one-shot with M_next > S, two-shot or reduce-scatter with S_next > S) they would land on rows we
may still be reading. Everything else is already ordered: our phase-2 reads of the scatter area
end before barrier 2, which every peer's grid passed before its next call started; peers write our
gather area of the next call only after its barrier 1, which we reach only once this grid ended
(stream order; NOTE [programmatic dependent launch]). So the barrier could go only with gather
areas that no pre-barrier push can reach (a gather region above every algorithm's push region,
capacities shrunk to fit), or with a pull-based first phase that writes only locally before
barrier 1 -- and one-shot / reduce-scatter then still pushing into the lower region.

NOTE [programmatic dependent launch]
With `pdl` the kernel is launched with the programmatic-stream-serialization attribute: it may be
scheduled while the previous kernel of the stream still runs, and its first instruction is
griddepcontrol.wait, which returns once that kernel has completed and its memory is visible. No
memory access precedes it, so every argument above that relies on stream order still holds; what
overlaps is the launch itself (block scheduling, the kernel's prologue). The kernel then calls
griddepcontrol.launch_dependents at once: the next kernel may be scheduled early, but if it is a
correct PDL consumer it also waits in griddepcontrol.wait for this grid's completion and memory
flush, so no consumer can see half-written outputs (the early-completion NaNs vLLM works around
come from consumers that read before that wait).

Barrier coverage: every dependency is between same-index CTAs. CTA b handles the same in-slice row
groups in every phase (one-shot: the same rows), so after cta_barrier every row CTA b reads was
written by CTA b of the producing rank. The grid is the same on all ranks (a function of M and the
SM count) and at most as many CTAs as are resident together whatever their register count
(compile_allreduce.co_resident_ctas_per_sm per SM), so all CTAs are co-resident and spinning CTAs
cannot starve the peers they wait for. Lamport's polling CTAs have the same requirement (a CTA polls
rows that the same-index CTAs of its peers push). Barrier region 1 serves one-shot, region 2 two-shot (0 is sync.py's test).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.collectives.layout import CALL_W_LAST, DEVICE_ERROR_WORD, region_word
from distnorm.collectives.plan import ALGORITHM_FORMS, ALGORITHMS
from distnorm.collectives.signature import (SIGNATURE_MULTIPLIER, CallDescriptor,
                                            signature_constant)
from distnorm.formats import VEC, QuantSpec
from distnorm.kernels.lamport import LamportOneShot
from distnorm.kernels.norm_quant import NormQuantCore
from distnorm.kernels.tiling import RowTiling
from distnorm.kernels.sync import cta_barrier, ld_volatile_sys_u32, st_volatile_sys_v4_u32


# NOTE [slice batches]
# Two-shot's phase 1 (a row of every other slice: load from x, store to its owner or to my copy) and
# phase 3 (a gathered row of every other slice, then its epilogue) visit the N-1 other slices one
# after another. Issued one slice at a time, each slice's load waits for the previous slice's
# stores (the compiler cannot tell x from the peer buffers) or epilogue, so a CTA pays N-1 load
# latencies per row group, NVLink latencies in the pull forms. Slices therefore go in batches: the
# batch's loads first, then its stores / epilogues, SLICE_BATCH_VECS vectors in flight per thread
# (a batch is one slice at world 2, which keeps that kernel as it was).
SLICE_BATCH_VECS = 16


class AllReduceAddRMSNormQuant(LamportOneShot):
    """Compile-time: algo, world size, tiling (H), quant, residual/gemma/write_y/write_allreduce.

    Run-time: M (rows of x), rank, grid size, eps, timeout, the peer-pointer tables.
    """

    def __init__(self, algo: str, world: int, tiling: RowTiling, quant: QuantSpec,
                 has_residual: bool, gemma: bool, write_y: bool, write_allreduce: bool,
                 pdl: bool = False, dtype: str = "bfloat16", form: str = ""):
        assert algo in ALGORITHMS, algo
        forms = ALGORITHM_FORMS.get(algo, ("",))
        form = form or forms[0]
        assert form in forms, (algo, form)
        assert tiling.cluster_n == 1, "the all-reduce kernels use one CTA per row group"
        self.algo = algo
        self.world = world
        self.t = tiling
        self.q = quant
        self.has_residual = has_residual
        self.write_allreduce = write_allreduce
        self.pdl = pdl  # NOTE [programmatic dependent launch]
        # NOTE [two-shot forms], NOTE [lamport polls]
        self.pull_scatter = algo == "twoshot" and form == "pull"
        self.pull_gather = algo == "twoshot" and form in ("pull", "pull-gather")
        self.poll_unseen = algo == "lamport" and form == "poll-unseen"
        # two-shot gathers T(acc) separately only when it differs from the gathered h
        self.gather_acc = write_allreduce and has_residual
        # signal-pad region: one-shot's / two-shot's barrier, lamport's call state
        self.region_word = region_word(ALGORITHMS[algo].region)
        self.core = NormQuantCore(tiling, quant, gemma, write_y)
        # NOTE [slice batches]
        self.slice_batch = 1 if world <= 2 else max(1, SLICE_BATCH_VECS // tiling.vecs_per_thread)
        # NOTE [call descriptor]: words 1-3 of this kernel's descriptor and its signature constant
        # (collectives/signature.py); word 0 is the launch's M
        self.desc = CallDescriptor(0, tiling.hidden, algo, dtype, quant, has_residual, write_y,
                                   write_allreduce, gemma, world, form).words()
        self.sig_const = signature_constant(self.desc)

    # ---- host side -----------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mR, mRout, mW: cute.Tensor, mY, mQ, mS, mScale, mGS, mAR,
                 mBuf: cute.Tensor, mSig: cute.Tensor, mErr: cute.Tensor, rank: Int32,
                 max_ctas: Int32, eps: Float32, timeout: Int64, stream):
        t = self.t
        m = mX.shape[0]
        rows = m
        if const_expr(self.q.swizzled):
            rows = (m + 127) // 128 * 128  # the 128x4 scale layout's padded rows are written too
        slice_rows = rows
        if const_expr(self.algo == "twoshot"):
            slice_rows = (rows + self.world - 1) // self.world
        groups = (slice_rows + t.rows_per_cta - 1) // t.rows_per_cta
        if const_expr(self.algo == "reducescatter"):
            # shard rows of M (unpadded), then this rank's shard rows (padded for swizzled
            # scales); the grid covers every rank's padded shard, so it is the same on all ranks
            slice_rows = (m + self.world - 1) // self.world
            rows = m - rank * slice_rows
            if rows > slice_rows:
                rows = slice_rows
            if rows < 0:
                rows = Int32(0)
            span = slice_rows
            if const_expr(self.q.swizzled):
                rows = (rows + 127) // 128 * 128
                span = (slice_rows + 127) // 128 * 128
            groups = (span + t.rows_per_cta - 1) // t.rows_per_cta
        blocks = groups
        if blocks > max_ctas:
            blocks = max_ctas
        if blocks < 1:
            blocks = Int32(1)
        self.kernel(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank, eps,
                    timeout, rows, slice_rows, groups).launch(
            grid=[blocks, 1, 1],
            block=[t.threads, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    # ---- device helpers --------------------------------------------------------------------------
    @cute.jit
    def _row_view(self, base: Int64, elem_offset: Int64, dtype: cutlass.Constexpr):
        """[H] tensor of `dtype` at byte address base + elem_offset elements, tiled in vectors."""
        ptr = cute.make_ptr(dtype, base + elem_offset * (dtype.width // 8), cute.AddressSpace.gmem,
                            assumed_align=16)
        row = cute.make_tensor(ptr, cute.make_layout((self.t.hidden,), stride=(1,)))
        return cute.zipped_divide(row, (VEC,))

    @cute.jit
    def _sum_slots(self, rH, rT, base: Int64, slot_elems: Int64, row_elem: Int64, own: Int64,
                   rank: Int32, lane: Int32, mBuf=None):
        """rH <- float32 sum over slots 0..N-1 (rank order) of the local buffer's row `row_elem`,
        slot `rank` read from address `own` instead (this rank's own row: never sent to itself).
        With mBuf (the "pull" two-shot), slot s is row `row_elem` of rank s's own buffer."""
        dtype = rT.element_type
        for s in cutlass.range_constexpr(self.world):
            src = base + (slot_elems * s + row_elem) * Int64(dtype.width // 8)
            if const_expr(mBuf is not None):
                src = mBuf[s] + row_elem * Int64(dtype.width // 8)
            if Int32(s) == rank:
                src = own
            self.core.load_row(rT, self._row_view(src, Int64(0), dtype), lane)
            self.core.fold(rH, rT, s)

    @cute.jit
    def _finish_row(self, rH, rR, mAR, mRout, row: Int32, lane: Int32, dtype: cutlass.Constexpr):
        """After a row's ordered sum (rH = float32 acc, rR = its residual): T(acc) -> allreduce_out,
        h -> residual_out; rH is left holding float(h) for the epilogue."""
        if const_expr(self.write_allreduce):
            self.core.store_row(rH, cute.zipped_divide(mAR[row, None], (VEC,)), lane, dtype)
        self.core.round_sum(rH, rR, self.has_residual, dtype)
        if const_expr(self.has_residual):
            self.core.store_row(rH, cute.zipped_divide(mRout[row, None], (VEC,)), lane, dtype)

    @cute.jit
    def _reduce_row(self, rH, rR, rT, mX, mR, mRout, mAR, base: Int64, slot_elems: Int64,
                    slot_row: Int32, x_row: Int32, out_row: Int32, row_valid,
                    rank: Int32, lane: Int32, dtype: cutlass.Constexpr):
        """rH <- the ordered float32 sum of row `slot_row` of the local slots (my own part from x's
        row `x_row`), then h with the residual of row `out_row`, written to residual_out /
        allreduce_out row `out_row` (_finish_row); zeros when not row_valid."""
        rH.fill(0.0)
        if row_valid:
            if const_expr(self.has_residual):
                self.core.load_row(rR, cute.zipped_divide(mR[out_row, None], (VEC,)), lane)
            self._sum_slots(rH, rT, base, slot_elems, Int64(slot_row) * Int64(self.t.hidden),
                            self._row_addr(mX, x_row), rank, lane)
            self._finish_row(rH, rR, mAR, mRout, out_row, lane, dtype)

    def _slice_frags(self, rT) -> list:
        """One register fragment per slice of a batch (NOTE [slice batches]), rT the first."""
        return [rT] + [self.core.zeros(rT.element_type) for _ in range(self.slice_batch - 1)]

    @staticmethod
    def _row_addr(mT, row) -> Int64:
        """Byte address of row `row` of a [M, H] tensor."""
        return mT[row, None].iterator.toint()

    def _indices(self):
        """(thread, CTA, grid size, row of this thread among the CTA's rows, lane in its row)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        return tidx, bidx, nblk, tidx // self.t.threads_per_row, tidx % self.t.threads_per_row

    def _fragments(self, dtype, mW, mScale, mGS, lane):
        """What every algorithm starts with: the epilogue's shared-memory partials, zeroed register
        fragments for a row of T (rT), the residual (rR) and float32 h (rH), the quantization
        scalars and this thread's weight vectors (loaded here, early: their latency hides behind
        the exchange)."""
        bufs = self.core.allocate_smem(cutlass.utils.SmemAllocator())
        rT = self.core.zeros(dtype)
        rR = self.core.zeros(dtype)
        rH = self.core.zeros(Float32)
        static_inv, global_scale = self.core.load_scalars(mScale, mGS)
        rW = self.core.load_weight(mW, lane)
        return bufs, rT, rR, rH, static_inv, global_scale, rW

    @cute.jit
    def _barrier(self, mSig, rank: Int32, bidx: Int32, timeout: Int64, mErr, sig: Int32) -> Int32:
        """The cross-rank CTA barrier; 1 (on every thread of the CTA) when it failed."""
        return cta_barrier(mSig, rank, self.world, self.region_word, bidx, timeout, mErr, sig)

    @cute.jit
    def _unless_failed(self, failed: Int32, groups: Int32) -> Int32:
        """``groups``, or 0 after a failed barrier (NOTE [a failed rank arrives nowhere]): the
        rest of the launch writes nothing, to peers or outputs. ``failed`` is the same on every
        thread of the CTA, so the epilogue's CTA barriers stay matched."""
        n = groups
        if failed != Int32(0):
            n = Int32(0)
        return n

    @cute.jit
    def _push_groups(self, mSig, rank: Int32, groups: Int32) -> Int32:
        """``groups``, or 0 when this rank's device error word is already set (a launch queued
        before the host saw an earlier failure): NOTE [a failed rank arrives nowhere]. Per thread:
        the push loops have no CTA barrier."""
        return self._unless_failed(ld_volatile_sys_u32(mSig[rank] + Int64(DEVICE_ERROR_WORD * 4)),
                                   groups)

    @cute.jit
    def _describe_launch(self, mSig, rank: Int32, m: Int32) -> Int32:
        """NOTE [call descriptor]: record this launch's descriptor in my signal pad (thread 0 of
        CTA 0; the host reads it when a call fails) and return its 32-bit signature."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if (tidx == 0) & (bidx == 0):
            st_volatile_sys_v4_u32(mSig[rank] + Int64(CALL_W_LAST * 4), m, Int32(self.desc[1]),
                                   Int32(self.desc[2]), Int32(self.desc[3]))
        return (m * Int32(SIGNATURE_MULTIPLIER)) ^ Int32(self.sig_const)

    # ---- the kernel ------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR, mRout, mW: cute.Tensor, mY, mQ, mS, mScale, mGS, mAR,
               mBuf: cute.Tensor, mSig: cute.Tensor, mErr: cute.Tensor, rank: Int32, eps: Float32,
               timeout: Int64, rows: Int32, slice_rows: Int32, groups: Int32):
        if const_expr(self.pdl):
            # NOTE [programmatic dependent launch]
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.algo == "oneshot"):
            self._oneshot(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank,
                          eps, timeout, rows, groups)
        if const_expr(self.algo == "lamport"):
            self._lamport(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank,
                          eps, timeout, rows, groups)
        if const_expr(self.algo == "twoshot"):
            self._twoshot(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank,
                          eps, timeout, rows, slice_rows, groups)
        if const_expr(self.algo == "reducescatter"):
            self._reducescatter(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                                rank, eps, timeout, rows, slice_rows, groups)

    @cute.jit
    def _oneshot(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                 rank: Int32, eps: Float32, timeout: Int64, rows: Int32, groups: Int32):
        t = self.t
        dtype = mX.element_type
        _, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        slot_elems = Int64(m) * hidden  # one slot: this call's M rows

        bufs, rT, rR, rH, static_inv, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane)
        sig = self._describe_launch(mSig, rank, m)

        # phase 1: push my rows into slot `rank` of every other rank's buffer (phase 2 reads my own
        # rows from x: nobody else reads my slot)
        for g in range(bidx, self._push_groups(mSig, rank, groups), nblk):
            row = g * t.rows_per_cta + row_in_cta
            if row < m:
                self.core.load_row(rT, cute.zipped_divide(mX[row, None], (VEC,)), lane)
                off = slot_elems * Int64(rank) + Int64(row) * hidden
                for s in cutlass.range_constexpr(self.world):
                    if Int32(s) != rank:
                        self.core.store_row(rT, self._row_view(mBuf[s], off, dtype), lane, dtype)
        failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)

        # phase 2: ordered float32 sum of the N slots, residual add, epilogue
        base = mBuf[rank]
        for g in range(bidx, self._unless_failed(failed, groups), nblk):
            row = g * t.rows_per_cta + row_in_cta
            row_valid = row < m
            self._reduce_row(rH, rR, rT, mX, mR, mRout, mAR, base, slot_elems, row, row, row,
                             row_valid, rank, lane, dtype)
            self.core.epilogue(rH, row, row_valid, row < rows, lane, row_in_cta, eps, mW,
                               mY, mQ, mS, static_inv, global_scale, bufs, rW)
            cute.arch.barrier()  # the next group's reductions reuse the shared-memory partials
        # nobody may overwrite a slot (next call) that a peer still reads
        self._barrier(mSig, rank, bidx, timeout, mErr, sig)

    @cute.jit
    def _push_slices(self, mX, mBuf, rank: Int32, slice_rows: Int32, push_groups: Int32,
                     bidx: Int32, nblk: Int32, row_in_cta: Int32, lane: Int32, rT,
                     dtype: cutlass.Constexpr):
        """Reduce-scatter push: row i of slice s -> rank s, slot `rank`, row i (S = slice_rows
        rows per slot, push_groups >= ceil(S / rows_per_cta) row groups); my own slice stays in x.
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
                    row = s * slice_rows + i
                    if (i < slice_rows) & (row < m) & (Int32(s) != rank):
                        self.core.load_row(frags[s - b0], cute.zipped_divide(mX[row, None], (VEC,)),
                                           lane)
                for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                    row = s * slice_rows + i
                    if (i < slice_rows) & (row < m) & (Int32(s) != rank):
                        if const_expr(self.pull_scatter):
                            self.core.store_row(frags[s - b0], self._row_view(
                                mine, Int64(row) * hidden, dtype), lane, dtype)
                        else:
                            off = slot_elems * Int64(rank) + Int64(i) * hidden
                            self.core.store_row(frags[s - b0], self._row_view(mBuf[s], off, dtype),
                                                lane, dtype)

    @cute.jit
    def _reducescatter(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                       rank: Int32, eps: Float32, timeout: Int64, rows: Int32, slice_rows: Int32,
                       groups: Int32):
        """Sequence-parallel form: two-shot's reduce-scatter, then the epilogue of my shard only,
        into shard-local outputs (residual, y, q, scales have the shard's rows; `rows`: the shard's
        rows of the scale layout). No gather: collectives/seqpar.py gathers q and scales."""
        t = self.t
        dtype = mX.element_type
        _, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        slot_elems = Int64(slice_rows) * hidden
        local = m - rank * slice_rows  # rows of my shard
        if local > slice_rows:
            local = slice_rows
        bufs, rT, rR, rH, static_inv, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane)
        sig = self._describe_launch(mSig, rank, m)
        push_groups = (slice_rows + t.rows_per_cta - 1) // t.rows_per_cta
        self._push_slices(mX, mBuf, rank, slice_rows, self._push_groups(mSig, rank, push_groups),
                          bidx, nblk, row_in_cta, lane, rT, dtype)
        failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)

        base = mBuf[rank]
        for g in range(bidx, self._unless_failed(failed, groups), nblk):
            i = g * t.rows_per_cta + row_in_cta
            row_valid = i < local
            self._reduce_row(rH, rR, rT, mX, mR, mRout, mAR, base, slot_elems, i,
                             rank * slice_rows + i, i, row_valid, rank, lane, dtype)
            self.core.epilogue(rH, i, row_valid, i < rows, lane, row_in_cta, eps, mW, mY, mQ, mS,
                               static_inv, global_scale, bufs, rW)
            cute.arch.barrier()  # shared-memory partials are reused by the next row
        # nobody may overwrite a slot (next call) that a peer still reads
        self._barrier(mSig, rank, bidx, timeout, mErr, sig)

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
                 groups: Int32):
        t = self.t
        dtype = mX.element_type
        _, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        sl = Int64(slice_rows)
        slot_elems = sl * hidden                       # one scatter slot: S rows
        gather_h = slot_elems * self.world             # gather area of h: N*S rows
        gather_a = gather_h + slot_elems * self.world  # gather area of T(acc) (when asked)

        bufs, rT, rR, rH, static_inv, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane)
        rA = self.core.zeros(Float32)
        sig = self._describe_launch(mSig, rank, m)

        # phase 1 (reduce-scatter push); my own slice stays in x (phase 2 reads it there)
        self._push_slices(mX, mBuf, rank, slice_rows, self._push_groups(mSig, rank, groups), bidx,
                          nblk, row_in_cta, lane, rT, dtype)
        failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)

        # phase 2: reduce my slice, residual add, push T(h) (and T(acc)) to the other ranks' gather
        # areas, then finish my slice's rows here: their epilogue overlaps the NVLink traffic
        # instead of re-reading h in phase 3
        base = mBuf[rank]
        for g in range(bidx, self._unless_failed(failed, groups), nblk):
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
                    self._gather_row(rH, rA, base, gather_h, gather_a, row, lane, dtype)
                else:
                    for s in cutlass.range_constexpr(self.world):
                        if Int32(s) != rank:
                            self._gather_row(rH, rA, mBuf[s], gather_h, gather_a, row, lane, dtype)
                if const_expr(self.has_residual):
                    self.core.store_row(rH, cute.zipped_divide(mRout[row, None], (VEC,)), lane, dtype)
                if const_expr(self.write_allreduce):
                    src = rH
                    if const_expr(self.gather_acc):
                        src = rA
                    self.core.store_row(src, cute.zipped_divide(mAR[row, None], (VEC,)), lane, dtype)
            self.core.epilogue(rH, row, row_valid, (i < slice_rows) & (row < rows), lane,
                               row_in_cta, eps, mW, mY, mQ, mS, static_inv,
                               global_scale, bufs, rW)
            cute.arch.barrier()  # shared-memory partials are reused by the next row
        failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig) | failed

        # phase 3: the other ranks' slices: full rows of gathered h -> residual_out, allreduce_out,
        # epilogue
        gathered = self._slice_frags(rT)
        for g in range(bidx, self._unless_failed(failed, groups), nblk):
            i = g * t.rows_per_cta + row_in_cta
            for b0 in cutlass.range_constexpr(0, self.world, self.slice_batch):  # NOTE [slice batches]
                if const_expr(self.slice_batch > 1):  # the batch's loads first
                    for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                        row = s * slice_rows + i
                        if (i < slice_rows) & (row < m) & (Int32(s) != rank):
                            self.core.load_row(gathered[s - b0], self._row_view(
                                self._gather_source(base, mBuf, s), gather_h + Int64(row) * hidden,
                                dtype), lane)
                for s in cutlass.range_constexpr(b0, min(self.world, b0 + self.slice_batch)):
                    self._gathered_row(gathered[s - b0], rT, rH, s, i, rank, slice_rows, m, rows,
                                       base, gather_h, gather_a, mBuf, mAR, mRout, mW, mY, mQ, mS,
                                       lane, row_in_cta, eps, static_inv, global_scale, bufs, rW,
                                       dtype)
        self._barrier(mSig, rank, bidx, timeout, mErr, sig)

    @cute.jit
    def _gather_source(self, base: Int64, mBuf, s: cutlass.Constexpr) -> Int64:
        """Whose buffer holds slice s's gathered rows: mine, or in the pull forms its owner's
        (NOTE [two-shot forms])."""
        src = base
        if const_expr(self.pull_gather):
            src = mBuf[s]
        return src

    @cute.jit
    def _gathered_row(self, rG, rT, rH, s: cutlass.Constexpr, i: Int32, rank: Int32,
                      slice_rows: Int32, m: Int32, rows: Int32, base: Int64, gather_h: Int64,
                      gather_a: Int64, mBuf, mAR, mRout, mW, mY, mQ, mS, lane: Int32,
                      row_in_cta: Int32, eps: Float32, static_inv, global_scale, bufs, rW,
                      dtype: cutlass.Constexpr):
        """Two-shot phase 3 for row i of slice s: its gathered T(h) (in rG when batches loaded it,
        NOTE [slice batches]; loaded here into rT otherwise) -> residual_out, allreduce_out,
        epilogue. Nothing for my own slice (uniform over the CTA: the epilogue's barriers stay
        matched)."""
        hidden = Int64(self.t.hidden)
        if Int32(s) != rank:
            row = s * slice_rows + i
            row_valid = (i < slice_rows) & (row < m)
            rH.fill(0.0)
            src = self._gather_source(base, mBuf, s)
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
                               row_in_cta, eps, mW, mY, mQ, mS, static_inv, global_scale, bufs,
                               rW)
            cute.arch.barrier()  # shared-memory partials are reused by the next row
