"""Single-GPU fused kernel: [residual add] + RMSNorm + [quantization], one pass over HBM.

One CTA (or a cluster of `cluster_n` CTAs sharing the row's threads) handles `rows_per_cta` rows;
the epilogue is `NormQuantCore.epilogue`, the same code the all-reduce kernels end with, and the
cluster size never changes a row's bits (NOTE [batch invariance] in norm_quant.py). With `pdl` the
kernel is a programmatic-dependent-launch consumer and producer exactly as the all-reduce kernels
are (NOTE [programmatic dependent launch] in allreduce.py): no memory access precedes
griddepcontrol.wait, so stream order holds; what overlaps the previous kernel is the launch.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from distnorm.formats import VEC, QuantSpec, swizzled_tile_words  # absolute imports: see compat.py
from distnorm.kernels.compat import SmemAllocator
from distnorm.kernels.norm_quant import NormQuantCore
from distnorm.kernels.tiling import RowTiling, pad_clusters, pad_words_per_thread


# NOTE [padding CTAs]
# The swizzled scale layout has whole 128-row tiles, so a call of M rows also writes zero scales for
# rows M .. round_up(M, 128) - 1 of its last tile. Extra CTAs after the row CTAs do that and only
# that: the tile's 4-byte words in memory order, skipping the words of real rows
# (NormQuantCore.store_padding_scales), so a warp stores 128 contiguous bytes; about PAD_CTAS of
# them, at least MIN_PAD_WORDS words per thread. Before, padding rows were handed out like real rows
# (16 per CTA, a byte store per block) and their CTAs finished last at M = 1: NVFP4 at H = 8192
# took 2.97 us against 2.59 for the linear layout, which has no padding
# (benchmarks/results/pad_coalesced_ab_h200.md: 4, 16, 64, 256 words per thread, then this rule).
# They come after the row CTAs: first in the grid they delay the rows' start (+2..+11% at 1-17 rows;
# 16-byte units do not help, nor do row CTAs that zero the tile: split_padding_h200.md). First is
# 6-16% faster at 12288 / 14336 x 19-28 rows only where a call follows itself with programmatic
# dependent launch: the next grid is placed while this one holds the SMs and is packed (104 CTAs on
# 70 SMs), and the order changes that packing; with PDL off the times are smooth in M and first is
# 0.5-3% slower everywhere (benchmarks/results/pad_first_pdl_h200.md). No padding rule: NOTE [one
# CTA per SM] removes the packing instead.
# (PAD_CTAS, MIN_PAD_WORDS and the arithmetic: kernels/tiling.py, which the host reads too)

# NOTE [one CTA per SM]
# With programmatic dependent launch a call's grid is placed while the previous kernel still holds
# the SMs, and the block scheduler packs it onto the SMs free at that moment: NVFP4 at 14336 x 24
# rows, 104 CTAs behind a call of the same kernel, ran on 70 SMs, 34 of them holding two, which took
# 1.2x the cycles of a CTA alone (per-CTA %smid stamps; none doubled with PDL off). Swizzled split
# calls of 18-31 rows from H = 8192 (ops._one_cta_per_sm: where the whole grid, padding CTAs
# included, fits the SMs) therefore reserve ONE_CTA_SMEM of shared memory, more than half an SM's,
# so no SM takes two of their CTAs. H200, PDL on: MXFP8 / NVFP4 at 8192-14336 x 18-31 rows -2..-17%
# (NVFP4 12288 x 24 3.17 -> 2.68 us), with PDL off even (-1.7..+0.5%); at H = 4096 mixed (-3.1..+4.4%)
# and at 17 rows +1.6..+4.5% (no packing there), so neither takes it; at 40 rows the grid would
# need two waves (+17..+47%). benchmarks/results/one_cta_per_sm_h200.md. Behind a cuBLAS GEMM (a
# model's case: 128 GEMM CTAs of 164-213 KB hold 128 of 132 SMs at decode sizes) the same reservation
# for every cluster-1 call of up to 64 rows at H 4096-14336 was within noise of none in three of four
# runs (benchmarks/results/after_gemm_h200.md; branch wip/one-cta-wide), so it stays this narrow.
# DISTNORM_ONE_CTA_PER_SM=0 turns it off (ops.one_cta_from_env).
ONE_CTA_SMEM = 120 * 1024  # > 228 KB / 2: the shared memory of an sm_90 / sm_100 SM

# NOTE [split rows]
# At decode a row's canonical threads (NOTE [batch invariance] in norm_quant.py) sit on one SM and
# the quantizer's per-element arithmetic on them is most of the call. With split = S, S CTAs take
# the same row: each loads it, computes the same sum of squares (the same float32 operations, so
# the same bits) and the same scales, and stores only the vectors j of its thread slices with
# j % S == its part, so the arithmetic after the reduction is spread over S times the threads. The
# extra loads hit L2 (the parts run at the same time). The parts are not ordered, so an output
# that starts where an input does (in place) would be overwritten under a part still loading it:
# the host then never splits (ops._writes_where_it_reads). A row spread over a cluster is split
# into S clusters the same way (`group` counts clusters).

# NOTE [weights with the row loads]
# A split part (NOTE [split rows]) loads its weight vectors right after the row's loads, not in the
# epilogue: there they came after the residual stores (sm_90a SASS of the split kernels), so at one
# row only the row reduction hid their latency. Unsplit kernels keep the epilogue's load, which the
# reduction hides as well, without a fragment of weights live across the add. Measured on H200
# against the scalars change alone (benchmarks/results/scalars_after_loads_ab{435,481}_h200.md):
# CuTe DSL 4.8.1 static FP8 and NVFP4 0..-5%, per-token even; 4.3.5 mixed (static FP8 at 2048 x 4-16
# rows -7..-9%, at 48 rows +1..+4%; per-token up to +3%).

# NOTE [slots]
# Without peer memory an all-reduce gathers the ranks' rows with NCCL (collectives/nopeer.py) and
# ends in this kernel: with slots = N, x is [N, M, H] (slot s: rank s's rows, any slot stride) and a
# row's h is T(x_0 + x_1 + ... + x_{N-1} + float(res)), summed in float32 in rank order and rounded
# once -- NormQuantCore.fold and round_sum, the peer kernels' own code, so the outputs are bitwise
# theirs (NOTE [batch invariance] in norm_quant.py for the epilogue). In one kernel instead of a
# float32 sum in torch (N - 1 passes over memory and a float32 tensor) and then this kernel.


class FusedAddRMSNormQuant:
    """Compile-time settings live on the object; rows (M) and strides are run-time."""

    def __init__(self, tiling: RowTiling, quant: QuantSpec, has_residual: bool, gemma: bool,
                 write_y: bool, pdl: bool = False, split: int = 1, slots: int = 1,
                 one_cta_per_sm: bool = False):
        self.t = tiling
        self.one_cta_per_sm = one_cta_per_sm  # NOTE [one CTA per SM]
        self.slots = slots  # NOTE [slots]: x is [slots, M, H] when > 1
        self.pdl = pdl
        self.q = quant
        self.has_residual = has_residual
        self.split = split  # NOTE [split rows]
        self.core = NormQuantCore(tiling, quant, gemma, write_y, split)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mR, mRout, mW: cute.Tensor, mY, mQ, mS, mScale, mGS,
                 eps: Float32, stream):
        t = self.t
        m = self._row_count(mX)
        rows = m
        blocks = (m + t.rows_per_cta - 1) // t.rows_per_cta * self.split
        if const_expr(self.q.swizzled):
            rows = (m + 127) // 128 * 128  # the 128x4 scale layout's padded rows are written too
            # NOTE [padding CTAs]: only when the last tile is partial
            blocks += self._pad_clusters() * ((m % 128 + 127) // 128)
        self.kernel(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, eps, rows).launch(
            grid=[blocks * t.cluster_n, 1, 1],
            block=[t.threads, 1, 1],
            cluster=[t.cluster_n, 1, 1] if const_expr(t.cluster_n > 1) else None,
            smem=ONE_CTA_SMEM if self.one_cta_per_sm else None,  # None: what the kernel uses
            stream=stream,
            use_pdl=self.pdl,
        )

    def _row_count(self, mX):
        """M: x is [M, H], or [slots, M, H] (NOTE [slots])."""
        return mX.shape[1] if self.slots > 1 else mX.shape[0]

    def _pad_words_per_thread(self) -> int:
        """Words each padding CTA thread zeroes (NOTE [padding CTAs])."""
        return pad_words_per_thread(self.t, swizzled_tile_words(self.t.hidden // self.q.group_size))

    def _pad_clusters(self) -> int:
        """Clusters (CTAs without one) that zero a partial last tile's padding scales."""
        return pad_clusters(self.t, swizzled_tile_words(self.t.hidden // self.q.group_size))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR, mRout, mW: cute.Tensor, mY, mQ, mS, mScale, mGS,
               eps: Float32, rows: Int32):
        t = self.t
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        bufs = self.core.allocate_smem(smem)
        cta_rank = Int32(0)
        if const_expr(t.cluster_n > 1):
            cta_rank = cute.arch.block_idx_in_cluster()
            self.core.arm_cluster_exchange(bufs, tidx)
            # peers' smem and armed mbarriers must exist before our DSMEM stores
            cute.arch.cluster_arrive_relaxed()
        row_in_cta = tidx // t.threads_per_row
        lane = cta_rank * t.threads_per_row + tidx % t.threads_per_row  # among the row's threads
        group = bidx // t.cluster_n  # CTA (cluster) index: row block * split + part
        row = (group // self.split) * t.rows_per_cta + row_in_cta
        part = None
        if const_expr(self.split > 1):
            part = group % self.split
        m = self._row_count(mX)
        if const_expr(self.q.swizzled):
            # NOTE [padding CTAs]: every CTA of a cluster agrees on the branch
            row_groups = (m + t.rows_per_cta - 1) // t.rows_per_cta * self.split
            if group >= row_groups:
                if const_expr(t.cluster_n > 1):
                    cute.arch.cluster_wait()  # its arrive is matched; it exchanges nothing
                pad_cta = bidx - row_groups * t.cluster_n
                per_thread = self._pad_words_per_thread()
                self.core.store_padding_scales(mS, m, pad_cta * per_thread * t.threads, tidx,
                                               t.threads, per_thread)
            else:
                self._fuse_row(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, eps, rows, row, lane,
                               row_in_cta, bufs, part)
        else:
            self._fuse_row(mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, eps, rows, row, lane,
                           row_in_cta, bufs, part)

    @cute.jit
    def _fuse_row(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, eps: Float32, rows: Int32,
                  row: Int32, lane: Int32, row_in_cta: Int32, bufs, part=None):
        m = self._row_count(mX)
        row_valid = row < m
        rX = self.core.zeros(mX.element_type)
        rR = self.core.zeros(mX.element_type)
        rH = self.core.zeros(Float32)
        # the scalars between the row's loads and its stores: NOTE [scalars after the row loads]
        # in norm_quant.py (after a store, a load could not be moved above it: they may alias)
        rW = None
        if const_expr(self.slots > 1):
            self._fold_row(mX, mR, row, row_valid, lane, rX, rR, rH)
            rW = self._split_weights(mW, lane, part)
            static_scale, global_scale = self.core.load_scalars(mScale, mGS)
            self._store_sum(mRout, row, row_valid, lane, part, rH, mX.element_type)
        else:
            self._load_row(mX, mR, row, row_valid, lane, rX, rR)
            rW = self._split_weights(mW, lane, part)
            static_scale, global_scale = self.core.load_scalars(mScale, mGS)
            self._add_row(mRout, row, row_valid, lane, part, rX, rR, rH)
        if const_expr(self.t.cluster_n > 1):
            # the start-up barrier (peers' mbarriers armed) completes while the row loads are in
            # flight; it must precede the first DSMEM store (NOTE [cluster exchange])
            cute.arch.cluster_wait()
        self.core.epilogue(rH, row, row_valid, row < rows, lane, row_in_cta, eps, mW, mY, mQ, mS,
                           static_scale, global_scale, bufs, rW, part)

    def _split_weights(self, mW, lane: Int32, part):
        """A split part's weight vectors (NOTE [weights with the row loads]); None without a split
        (the epilogue loads them)."""
        if self.split == 1:
            return None
        return self.core.load_weight(mW, lane, self.core.weight_columns(part))

    @cute.jit
    def _load_row(self, mX, mR, row: Int32, row_valid, lane: Int32, rX, rR):
        """rX, rR <- the row of x and of the residual (every load before any store: residual_out
        may alias residual)."""
        if row_valid:
            self.core.load_row(rX, cute.zipped_divide(mX[row, None], (VEC,)), lane)
            if const_expr(self.has_residual):
                self.core.load_row(rR, cute.zipped_divide(mR[row, None], (VEC,)), lane)

    @cute.jit
    def _add_row(self, mRout, row: Int32, row_valid, lane: Int32, part, rX, rR, rH):
        """rH <- float(h), h = T(float(x) + float(res)) (or x) from _load_row's fragments;
        h -> residual_out."""
        if const_expr(self.has_residual):
            # h = T(float(x) + float(res)), one rounding (in place in rX); the norm reads float(h)
            self.core.add_packed(rX, rR)
            if row_valid:
                self.core.store_row16(rX, mRout[row, None], lane, part)
        self.core.widen(rH, rX)

    @cute.jit
    def _fold_row(self, mX, mR, row: Int32, row_valid, lane: Int32, rX, rR, rH):
        """NOTE [slots]: rH <- float(h), h = T(x_0 + ... + x_{N-1} + float(res)) (the caller
        stores it to residual_out). rH stays zero on rows past M."""
        if row_valid:
            if const_expr(self.has_residual):
                self.core.load_row(rR, cute.zipped_divide(mR[row, None], (VEC,)), lane)
            for s in cutlass.range_constexpr(self.slots):
                self.core.load_row(rX, cute.zipped_divide(mX[s, row, None], (VEC,)), lane)
                self.core.fold(rH, rX, s)
            self.core.round_sum(rH, rR, self.has_residual, mX.element_type)

    @cute.jit
    def _store_sum(self, mRout, row: Int32, row_valid, lane: Int32, part, rH, dtype):
        """NOTE [slots]: residual_out <- _fold_row's h (float32 values of dtype, exact)."""
        if const_expr(self.has_residual):
            if row_valid:
                self.core.store_row(rH, cute.zipped_divide(mRout[row, None], (VEC,)), lane, dtype,
                                    part)
