"""Fused all-reduce + [residual add] + RMSNorm + [quantization] over peer-mapped buffers (NVLink P2P).

One kernel class, four compile-time algorithms:

- "oneshot" (latency): CTA b owns row groups g = b, b + grid, ... (rows_per_cta rows each, the
  thread -> row mapping of fused_norm.py). Phase 1 pushes this rank's x rows into slot `rank` of
  every OTHER rank's data buffer (128-bit stores through the peer mappings); cta_barrier; phase 2
  reads slots 0..N-1 of the local buffer (its own slot from x: a rank never sends to itself), sums
  them in float32 in rank order 0..N-1, h = T(acc + res),
  writes residual_out (and T(acc) when asked), then the shared NormQuantCore epilogue; a final
  cta_barrier so that no rank's next call overwrites a slot a peer is still reading.
  Buffer: [N slots][rows][H] of T (rows = M, or M padded to 128 for swizzled scales).

- "twoshot" (bandwidth): kernels/twoshot.py (NOTE [two-shot forms], NOTE [two-shot final barrier],
  NOTE [slice batches] there); "reducescatter" and "rsgather" (the sequence-parallel op):
  kernels/reducescatter.py (NOTE [reduce-scatter rounds], NOTE [gather in the epilogue]).

- "lamport" (latency, no barrier): one-shot whose readers poll the data itself. Three rotating
  areas (collectives/layout.py; sentinel: kernels/lamport.py); call c pushes its sanitized rows into area c mod 3,
  slot `rank`, of every other rank with 128-bit volatile stores, polls its local area until no word
  of the peers' slots is the sentinel (the residual and weight loads are issued before the polls),
  sums in rank order as one-shot (own rows from x), and refills the peers' slots of the previous
  call's area with the sentinel (the own slot is never written and stays sentinel).
  The area index lives in the signal pad (NOTE [lamport call state], NOTE [lamport clearing] in
  kernels/lamport.py).
  The buffer-pointer table has LAMPORT_AREAS * N entries: entry k * N + s = rank s's area k.

NOTE [programmatic dependent launch]
With `pdl` the kernel is launched with the programmatic-stream-serialization attribute: it may be
scheduled while the previous kernel of the stream still runs, and its first instruction is
griddepcontrol.wait, which returns once that kernel has completed and its memory is visible. No
memory access precedes it, so every argument above that relies on stream order still holds; what
overlaps is the launch itself (block scheduling, the kernel's prologue). The kernel then calls
griddepcontrol.launch_dependents at once: the next kernel may be scheduled early, but if it is a
correct PDL consumer it also waits in griddepcontrol.wait for this grid's completion and memory
flush, so no consumer can see half-written outputs (the early-completion NaNs vLLM works around
come from consumers that read before that wait). Whether the launch overlaps anything is the
predecessor's choice: behind a kernel that triggers no dependents before it ends (cuBLAS's
8192 x 8192 and 128-row GEMMs on H200) no CTA is placed early and a PDL launch costs 0.15-0.7 us
more than a plain one (single-GPU norm: benchmarks/results/after_gemm_pdl_stamps_h200.md);
DISTNORM_PDL=0 is the switch.

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
from distnorm.collectives.plan import ALGORITHM_FORMS, ALGORITHMS, knob
from distnorm.collectives.signature import (GRID_MULTIPLIER, SIGNATURE_MULTIPLIER,
                                            CallDescriptor, signature_constant)
from distnorm.formats import VEC, QuantSpec, pushed_scale_row_bytes, q_shape
from distnorm.kernels.bulkpush import BULK_FORM, bulk_round_groups
from distnorm.kernels.rolespush import ROLES_FORM, ROLES_PUSHERS, roles_fit
from distnorm.kernels.lamport import LamportOneShot
from distnorm.kernels.compat import SmemAllocator
from distnorm.kernels.norm_quant import NormQuantCore
from distnorm.kernels.tiling import RowTiling
from distnorm.kernels.reducescatter import RS_ALGOS, RS_FORM_ROUNDS, ReduceScatter
from distnorm.kernels.twoshot import TS_ROUNDS, TwoShot, slice_batch
from distnorm.kernels.sync import cta_barrier, ld_volatile_sys_u32, st_volatile_sys_v4_u32


# NOTE [padding words]
# The 128x4 swizzled scale layout has whole 128-row tiles, so a call of M rows also writes zero
# scales for rows M .. round_up(M, 128) - 1. Lamport hands out only the M real rows as row groups,
# and every thread of the grid zeroes the padding rows' scales of the last tile in memory order,
# in 16-byte units (4-byte words where a unit also holds real rows: NormQuantCore.
# store_padding_words; the single-GPU kernel's NOTE [padding CTAs]) before its polls, while it
# would wait anyway. (Words at first: at one row, 32 passes of a 17-instruction loop a thread on
# the 2 CTAs of the grid, a likely part of NVFP4 lamport's 5.5 us at one row against 4.6 at 8 rows
# on 2 x H200; the units take 8 passes, not yet timed.) Before, padding rows were row groups like
# real ones: at one NVFP4 row a grid of a CTA per padding row group, each through the call's polls
# and arrival.
# Measured on 4 x H200 (benchmarks/results/padding_words_ab_h200_x4.md): fused NVFP4 lamport
# 6.52 -> 6.08 us at 1 x 4096, 6.72 -> 5.22 at 8 x 4096, 8.22 -> 6.61 at 8 x 8192. One-shot keeps
# its padding row groups: there the words made one NVFP4 row 16% slower (8.53 -> 9.90 us at
# 1 x 4096: one CTA zeroes the whole tile, 64 words a thread, before a barrier the padding CTAs
# used to reach together). The words are written whether or not the call later fails (zeros, the
# same every call). The reduce-scatter does the same for its shard's last tile (its row groups are
# the S = ceil(M / N) shard rows, the same on every rank). Two-shot keeps padding row groups: its
# slices are laid out over the padded rows. Lamport's grid is then the real rows' (as for formats
# without padding), which also refills the previous call's area (NOTE [lamport clearing]): after
# a larger call, fewer CTAs share that.


class AllReduceAddRMSNormQuant(LamportOneShot, TwoShot, ReduceScatter):
    """Compile-time: algo, world size, tiling (H), quant, residual/gemma/write_y/write_allreduce.

    Run-time: M (rows of x), rank, grid size, eps, timeout, the peer-pointer tables.
    """

    def __init__(self, algo: str, world: int, tiling: RowTiling, quant: QuantSpec,
                 has_residual: bool, gemma: bool, write_y: bool, write_allreduce: bool,
                 pdl: bool = False, dtype: str = "bfloat16", form: str = ""):
        assert algo in ALGORITHMS, algo
        forms = ALGORITHM_FORMS.get(knob(algo), ("",))
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
        self.pull_scatter = algo == "twoshot" and form in ("pull", "pull-wide", "pull-rounds")
        self.pull_gather = algo == "twoshot" and form in ("pull", "pull-gather", "pull-wide",
                                                          "pull-rounds")
        self.wide = algo == "twoshot" and form.endswith("-wide")  # NOTE [wide two-shot]
        # NOTE [two-shot rounds]
        self.ts_rounds = TS_ROUNDS if algo == "twoshot" and form.endswith("-rounds") else 1
        self.poll_unseen = algo == "lamport" and form == "poll-unseen"
        # NOTE [reduce-scatter rounds]
        self.rs_rounds = RS_FORM_ROUNDS[form] if algo in RS_ALGOS else 1
        # NOTE [bulk-copy pushes]: row groups per round of the TMA pushes, 0 = thread stores
        # NOTE [reduce-scatter roles by TMA]: pusher CTAs, 0 = no roles ("serial" where its stages
        # do not fit)
        self.bulk_groups = 0
        self.roles_pushers = 0
        if algo in RS_ALGOS and form in (BULK_FORM, ROLES_FORM):
            from distnorm.kernels.compile_allreduce import co_resident_ctas_per_sm
            per_sm = co_resident_ctas_per_sm(tiling)  # both forms' shared memory is per SM
            if form == BULK_FORM:
                self.bulk_groups = bulk_round_groups(world, tiling.hidden, tiling.rows_per_cta,
                                                     per_sm)
                if self.bulk_groups > 0:
                    self.rs_rounds = -self.bulk_groups
            elif roles_fit(tiling.hidden, tiling.rows_per_cta, per_sm, 2):  # rs_rounds 1 already
                self.roles_pushers = ROLES_PUSHERS
        # NOTE [gather in the epilogue]: q's bytes per row, pushed to every peer as it is written
        self.gather_q = algo == "rsgather"
        self.s_row_bytes = 0  # and the scales' with them where their rows are whole 16-byte units
        if self.gather_q:
            assert quant.kind != "none", "rsgather gathers the quantized rows"
            self.q_row_bytes = q_shape(quant, 1, tiling.hidden)[1]  # one byte per code column
            assert self.q_row_bytes % 16 == 0, self.q_row_bytes
            self.s_row_bytes = pushed_scale_row_bytes(quant, tiling.hidden)
        self.gather_scales = self.s_row_bytes > 0
        # NOTE [swizzled scales gathered]: the scales tensor is then the whole swizzled output
        self.gather_swizzled = self.gather_scales and quant.swizzled
        # two-shot gathers T(acc) separately only when it differs from the gathered h
        self.gather_acc = write_allreduce and has_residual
        # signal-pad region: one-shot's / two-shot's barrier, lamport's call state
        self.region_word = region_word(ALGORITHMS[algo].region)
        self.core = NormQuantCore(tiling, quant, gemma, write_y)
        # NOTE [slice batches]; a wide two-shot's CTA moves one slice's rows
        self.slice_batch = 1 if self.wide else slice_batch(world, tiling)
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
        if const_expr(self.q.swizzled and self.algo == "lamport"):
            groups = (m + t.rows_per_cta - 1) // t.rows_per_cta  # NOTE [padding words]
        if const_expr(self.algo in RS_ALGOS):
            # shard rows of M (unpadded), then this rank's shard rows (padded for swizzled
            # scales); the grid covers every rank's padded shard, so it is the same on all ranks
            slice_rows = (m + self.world - 1) // self.world
            rows = m - rank * slice_rows
            if rows > slice_rows:
                rows = slice_rows
            if rows < 0:
                rows = Int32(0)
            if const_expr(self.q.swizzled):
                rows = (rows + 127) // 128 * 128
            # NOTE [padding words]: the shard's padding rows are zeroed by words, not row groups
            groups = (slice_rows + t.rows_per_cta - 1) // t.rows_per_cta
        blocks = groups
        if const_expr(self.algo == "lamport"):
            if max_ctas > 1:  # a CTA of its own checks the descriptors (NOTE [descriptor check])
                if blocks > max_ctas - 1:
                    blocks = max_ctas - 1
                blocks = blocks + 1
        if const_expr(self.wide):  # NOTE [wide two-shot]: a CTA per (slice, row group)
            blocks = groups * self.world
        if const_expr(self.roles_pushers > 0):
            # NOTE [reduce-scatter roles by TMA]: the pushers and a finisher per group, at least
            # one of each
            blocks = groups + self.roles_pushers
        if blocks > max_ctas:
            blocks = max_ctas
        if const_expr(self.wide):  # whole sets of world CTAs, at least one
            blocks = blocks // self.world * self.world
            if blocks < Int32(self.world):
                blocks = Int32(self.world)
        if const_expr(self.roles_pushers > 0):  # even where max_ctas says 1: two co-reside
            if blocks < 2:
                blocks = Int32(2)
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
            if const_expr(mBuf is not None):
                src = mBuf[s] + row_elem * Int64(dtype.width // 8)
            else:
                src = base + (slot_elems * s + row_elem) * Int64(dtype.width // 8)
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

    def _fragments(self, dtype, mW, mScale, mGS, lane, smem=None):
        """What every algorithm starts with: the epilogue's shared-memory partials, zeroed register
        fragments for a row of T (rT), the residual (rR) and float32 h (rH), the quantization
        scalars and this thread's weight vectors (loaded here, early: their latency hides behind
        the exchange). smem: the allocator to take the partials from when the caller allocates
        more after them (4.3.5's allocators each start at the same base)."""
        bufs = self.core.allocate_smem(SmemAllocator() if smem is None else smem)
        rT = self.core.zeros(dtype)
        rR = self.core.zeros(dtype)
        rH = self.core.zeros(Float32)
        static_scale, global_scale = self.core.load_scalars(mScale, mGS)
        rW = self.core.load_weight(mW, lane)
        return bufs, rT, rR, rH, static_scale, global_scale, rW

    @cute.jit
    def _barrier(self, mSig, rank: Int32, bidx: Int32, timeout: Int64, mErr, sig: Int32) -> Int32:
        """The cross-rank CTA barrier; 1 (on every thread of the CTA) when it failed."""
        return cta_barrier(mSig, rank, self.world, self.region_word, bidx, timeout, mErr, sig)

    @cute.jit
    def _unless_failed(self, failed: Int32, groups: Int32) -> Int32:
        """``groups``, or 0 after a failed barrier (NOTE [a failed rank arrives nowhere]): the
        loops that write to peers after a barrier write nothing more (the one-shot's epilogue,
        which writes only this rank's outputs, runs unbounded: NOTE [unbounded after failure]).
        ``failed`` is the same on every thread of the CTA, so the epilogue's CTA barriers stay
        matched."""
        n = groups
        if failed != Int32(0):
            n = Int32(0)
        return n

    @cute.jit
    def _may_push(self, own_pad: Int64) -> Int32:
        """1, or 0 when this rank's device error word is already set (a launch queued before the
        host saw an earlier failure): NOTE [a failed rank arrives nowhere]. Per thread: the push
        loops have no CTA barrier.
        NOTE [push guard]: the pushes load their rows whatever this says and only their stores
        wait for it, so the word's load latency overlaps the rows' (a loop bound made from it
        put both loads in a row: +0.3 us per one-shot / two-shot call at M = 1 on 2 x H200,
        benchmarks/results/faults_ab_h200_x2.md)."""
        return Int32(ld_volatile_sys_u32(own_pad + Int64(DEVICE_ERROR_WORD * 4)) == Int32(0))

    @cute.jit
    def _describe_launch(self, own_pad: Int64, m: Int32) -> Int32:
        """NOTE [call descriptor]: record this launch's descriptor in my signal pad (thread 0 of
        CTA 0; the host reads it when a call fails) and return its 32-bit signature, with the grid
        size folded in: the barriers pair CTAs by index, so ranks with other grids (another SM
        count, rows_per_cta or max_ctas) would read rows their peers' same-index CTAs never wrote;
        they raise a mismatch instead."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        if (tidx == 0) & (bidx == 0):
            st_volatile_sys_v4_u32(own_pad + Int64(CALL_W_LAST * 4), m, Int32(self.desc[1]),
                                   Int32(self.desc[2]), Int32(self.desc[3]))
        return ((m * Int32(SIGNATURE_MULTIPLIER)) ^ Int32(self.sig_const)) + Int32(nblk) * Int32(
            GRID_MULTIPLIER)

    # ---- the kernel ------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR, mRout, mW: cute.Tensor, mY, mQ, mS, mScale, mGS, mAR,
               mBuf: cute.Tensor, mSig: cute.Tensor, mErr: cute.Tensor, rank: Int32, eps: Float32,
               timeout: Int64, rows: Int32, slice_rows: Int32, groups: Int32):
        # my signal pad's address, read before the PDL wait: the table is written once, when the
        # workspace is built, so its load overlaps the previous kernel's tail (NOTE [push guard])
        own_pad = mSig[rank]
        if const_expr(self.pdl):
            # NOTE [programmatic dependent launch]
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.algo == "oneshot"):
            self._oneshot(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank,
                          eps, timeout, rows, groups, own_pad)
        if const_expr(self.algo == "lamport"):
            self._lamport(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank,
                          eps, timeout, rows, groups, own_pad)
        if const_expr(self.algo == "twoshot"):
            self._twoshot(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr, rank,
                          eps, timeout, rows, slice_rows, groups, own_pad)
        if const_expr(self.algo in RS_ALGOS):
            self._reducescatter(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                                rank, eps, timeout, rows, slice_rows, groups, own_pad)

    @cute.jit
    def _oneshot(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                 rank: Int32, eps: Float32, timeout: Int64, rows: Int32, groups: Int32,
                 own_pad: Int64):
        t = self.t
        dtype = mX.element_type
        _, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        slot_elems = Int64(m) * hidden  # one slot: this call's M rows

        bufs, rT, rR, rH, static_scale, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane)
        may_push = self._may_push(own_pad)
        sig = self._describe_launch(own_pad, m)

        # phase 1: push my rows into slot `rank` of every other rank's buffer (phase 2 reads my own
        # rows from x: nobody else reads my slot)
        for g in range(bidx, groups, nblk):
            row = g * t.rows_per_cta + row_in_cta
            if row < m:
                self.core.load_row(rT, cute.zipped_divide(mX[row, None], (VEC,)), lane)
                if may_push != Int32(0):  # NOTE [push guard]
                    off = slot_elems * Int64(rank) + Int64(row) * hidden
                    for s in cutlass.range_constexpr(self.world):
                        if Int32(s) != rank:
                            self.core.store_row(rT, self._row_view(mBuf[s], off, dtype), lane,
                                                dtype)
        self._barrier(mSig, rank, bidx, timeout, mErr, sig)  # a failure is in the error word

        # phase 2: ordered float32 sum of the N slots, residual add, epilogue. NOTE [unbounded
        # after failure]: this loop runs all its groups even after a failed barrier: it reads only
        # my own buffer and writes only my outputs (undefined in a failing call), and a bound made
        # from the barrier's result cost 0.046 us per call at 1-128 rows on 2 x H200
        # (benchmarks/results/faults_parts_ab_h200_x2.md, "bound"). Phases that write to peers
        # after a barrier (two-shot, the reduce-scatter's gather) keep _unless_failed.
        base = mBuf[rank]
        for g in range(bidx, groups, nblk):
            row = g * t.rows_per_cta + row_in_cta
            row_valid = row < m
            self._reduce_row(rH, rR, rT, mX, mR, mRout, mAR, base, slot_elems, row, row, row,
                             row_valid, rank, lane, dtype)
            self.core.epilogue(rH, row, row_valid, row < rows, lane, row_in_cta, eps, mW,
                               mY, mQ, mS, static_scale, global_scale, bufs, rW)
            cute.arch.barrier()  # the next group's reductions reuse the shared-memory partials
        # nobody may overwrite a slot (next call) that a peer still reads
        self._barrier(mSig, rank, bidx, timeout, mErr, sig)
