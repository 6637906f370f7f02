"""The norm-quant cores: RMSNorm and every quantizer, written once as CuTe DSL device code.

Every fused kernel (single GPU, one-shot and two-shot all-reduce) ends the same way: each thread holds
float32 values of the new residual `h` for its slice of one row, and `NormQuantCore.epilogue` turns
them into the bf16/fp16 norm output and the quantized bytes and scales of docs/SEMANTICS.md.

Thread layout (`RowTiling`): a row of H elements is cut into 16-byte vectors of 8 elements and
owned by `row_threads` threads (with a thread-block cluster, spread over its CTAs), row thread
`lane` holding vectors `lane + j * row_threads`. Groups and quantization blocks (16, 32, 64, 128
elements) are then 2..16 consecutive lanes of one warp, reduced with shuffles; the row sum of
squares goes warp -> shared memory (-> distributed shared memory of every CTA of the cluster).

NOTE [batch invariance]
A row's outputs must not depend on the batch it sits in, the algorithm or the kernel (single GPU or
all-reduce). Everything but the sum of squares is elementwise or a max (exact in any order); the
sum of squares is made order-stable: a row always has the same canonical threads (row_threads_for
depends on H only), each thread sums its vectors' squares in the same order, a warp combines its
32 lanes with the same butterfly, and the row's warp partials are added in warp order 0, 1, ... --
also across a cluster, where every CTA receives every warp's partial (not a per-CTA partial) and
adds them in that same order. So the cluster size (chosen from M) changes where threads run, never
the float32 operations, and the single-GPU kernel gives the all-reduce kernels' bits.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from distnorm.formats import (VEC, QuantSpec, swizzled_offset, swizzled_tile_words,
                              swizzled_word_row)
from distnorm.kernels import ptx
from distnorm.kernels.block_scales import BlockScales, pairwise
from distnorm.kernels.split_parts import SplitParts
from distnorm.kernels.sync import st_weak_u32, st_weak_v4_u32
from distnorm.kernels.tiling import RowTiling

# what _e2m1_biased_magnitude returns on top of the magnitude code: its rounded - binade is
# 0x0B000000 + steps, and binade >> 22 is 254 + 2 * exponent
E2M1_CODE_BIAS = 0x0B000000 + 254
# E2M1_CODE_BIAS in each of a word's 8 nibble sums, modulo 2^32, as an int32
PACKED_E2M1_BIAS = (sum(E2M1_CODE_BIAS << (4 * e) for e in range(VEC)) + (1 << 31)) % (1 << 32) - (1 << 31)

def half_name(dtype) -> str:
    """PTX name of a 16-bit activation dtype."""
    return "bf16" if dtype is cutlass.BFloat16 else "f16"


class NormQuantCore(BlockScales, SplitParts):
    """RMSNorm + quantization epilogue shared by every fused kernel.

    Built at trace time from compile-time values; its methods are called inside a @cute.kernel.
    """

    def __init__(self, tiling: RowTiling, quant: QuantSpec, gemma: bool, write_y: bool,
                 split: int = 1):
        self.t = tiling
        self.q = quant
        self.gemma = gemma
        self.write_y = write_y
        # NOTE [split rows]: `split` CTAs per row, part p storing vectors j % split == p
        assert split & (split - 1) == 0, "SplitParts.compact_part selects on the part's bits"
        self.split = split
        if quant.grouped:
            lanes = quant.group_size // VEC
            assert tiling.threads_per_row % lanes == 0 and lanes <= 32

    # ---- shared memory -------------------------------------------------------------------------
    def allocate_smem(self, smem):
        """Per-row partials: [rows_per_cta, warps_per_row] and (cluster) [rows_per_cta, row_warps]
        with the mbarrier that counts the cluster's partials in (NOTE [cluster exchange]), two
        phases."""
        t = self.t
        bufs = []
        for _ in range(2):  # phase 0: sum of squares, phase 1: per-token amax
            warp_buf = smem.allocate_tensor(
                Float32, cute.make_layout((t.rows_per_cta, max(1, t.warps_per_row))), byte_alignment=16
            )
            cta_buf = smem.allocate_tensor(
                Float32, cute.make_layout((t.rows_per_cta, t.row_warps if t.cluster_n > 1 else 1)),
                byte_alignment=16
            )
            mbar = None
            if t.cluster_n > 1:
                mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8)
            bufs.append((warp_buf, cta_buf, mbar))
        return bufs

    # NOTE [cluster exchange]
    # A row spread over a cluster sums its warps' partials in every CTA (NOTE [batch invariance]):
    # each warp stores its partial into every CTA's shared memory. With a plain store and the
    # cluster barrier, the barrier's release made every thread wait (MEMBAR.ALL.GPU in the SASS)
    # until its earlier global stores -- residual_out, y -- were acknowledged, on the critical
    # path of every decode call at H >= 16384 (ncu at M = 1: the most sampled stall). The partials
    # now travel by st.async, which counts its bytes on an mbarrier of the receiving CTA: a CTA
    # waits on its own mbarrier until all row_warps partials of each of its rows have landed, and
    # no fence orders the global stores. Each phase's mbarrier is armed once, at the kernel's
    # start (before the cluster's start-up barrier, which publishes it), so a kernel uses each
    # phase once (parity 0): the cluster kernels handle one row group per CTA.
    @cute.jit
    def arm_cluster_exchange(self, bufs, tidx: Int32):
        """Thread 0 arms both phases' mbarriers (NOTE [cluster exchange]); call before the
        cluster's start-up arrive."""
        t = self.t
        if tidx == 0:
            for phase in cutlass.range_constexpr(2):
                ptx.mbarrier_init_expect_tx(ptx.smem_ptr_u32(bufs[phase][2].iterator),
                                            Int32(t.rows_per_cta * t.row_warps * 4))
            ptx.fence_mbarrier_init_cluster()

    def zeros(self, dtype, vecs: int = 0):
        """A zero-filled register fragment holding this thread's vectors of one row (or `vecs`
        vectors)."""
        vecs = vecs or self.t.vecs_per_thread
        frag = cute.make_rmem_tensor(cute.make_layout(vecs * VEC), dtype)
        frag.fill(0.0)
        return frag

    # NOTE [scalars after the row loads]
    # The static scale travels as loaded and is inverted (rcp.rn, the same bits as before) where q
    # is stored, and the single-GPU kernel loads both scalars after it has issued its row loads.
    # Inverted at the load, the scale's MUFU.RCP waited for the load before the first row load
    # issued (sm_90a SASS of every single-GPU split and of lamport before its pushes, CuTe DSL
    # 4.3.5 and 4.8.1), and 4.8.1 moved NVFP4's global scale into a uniform register (R2UR, which
    # waits for the load too) ahead of the row loads of the 4-part split: a scalar load's latency
    # in front of the row's on the decode path. A load issued after the row loads waits for
    # nothing; its value is needed only once the row has been reduced. The all-reduce kernels keep
    # their early load (_fragments): with no instruction waiting on its value it stalls nothing
    # (sm_90a SASS of lamport and the one-shot on 4.8.1). Measured on H200 (benchmarks/
    # results/scalars_after_loads_ab{435,481}_h200.md, 1-48 rows x 2048-8192): static FP8 -6..-16%
    # on 4.8.1 and -1..-14% on 4.3.5, NVFP4 -1..-14%, per-token FP8 (no scalar) within 2%.
    @cute.jit
    def load_scalars(self, mScale, mGS):
        """(static scale, NVFP4 global scale) as loaded, for the formats that take them, else
        zeros (NOTE [scalars after the row loads])."""
        static_scale = Float32(0.0)
        global_scale = Float32(0.0)
        if const_expr(self.q.info.scalar == "scale"):
            static_scale = mScale[0]
        if const_expr(self.q.info.scalar == "global_scale"):
            global_scale = mGS[0]
        return static_scale, global_scale

    # ---- row loads and stores ------------------------------------------------------------------
    @cute.jit
    def _copy_row(self, frag, tRow, lane: Int32, store: cutlass.Constexpr, dtype,
                  width: cutlass.Constexpr = VEC, part=None, cols=None):
        """Between a register fragment and row thread `lane`'s vectors of the row tRow (tiled in
        vectors of `width` elements: 8 values, or 4 packed words): store -> tRow <- frag converted
        to dtype, else frag <- tRow. With `part`, only that part's vectors (NOTE [split rows]).
        cols: the vector columns j of the fragment's vectors (part_columns; default all)."""
        t = self.t
        if const_expr(cols is None):
            cols = self.part_columns(None)
        for k in cutlass.range_constexpr(len(cols)):
            v = lane + cols[k] * t.row_threads
            if const_expr(self._columns_exact(cols)) or v < t.vecs:
                if self._mine(cols[k], part):
                    if const_expr(store):
                        tRow[(None, v)].store(self._slice(frag, k, width).load().to(dtype))
                    else:
                        self._slice(frag, k, width).store(tRow[(None, v)].load())

    def load_row(self, dst, tSrc, lane: Int32):
        """dst (register fragment) <- row thread `lane`'s vectors of the row tSrc."""
        self._copy_row(dst, tSrc, lane, False, None)

    def store_row(self, src, tDst, lane: Int32, dtype, part=None, cols=None):
        """Row thread `lane`'s vectors of the row tDst <- src (register fragment) as dtype."""
        self._copy_row(src, tDst, lane, True, dtype, VEC, part, cols)

    @cute.jit
    def add_packed(self, rA, rB):
        """rA <- T(rA + rB) for 16-bit fragments of this thread's vectors: the reference's
        T(float(a) + float(b)) (ptx.add_x2), two elements per instruction instead of two
        conversions, an add, a conversion back and a repack per element."""
        wA = cute.recast_tensor(rA, Int32)
        wB = cute.recast_tensor(rB, Int32)
        half = half_name(rA.element_type)
        for i in cutlass.range_constexpr(self.t.vecs_per_thread * VEC // 2):
            wA[i] = ptx.add_x2(wA[i], wB[i], half)

    @cute.jit
    def fold(self, rH, rT, slot: cutlass.Constexpr):
        """rH <- the running float32 sum of the ranks' rows in rank order: float(rT) for slot 0,
        then rH + float(rT). The all-reduce's sum (docs/SEMANTICS.md), written once: the peer
        kernels and the single-GPU kernel's slots (NOTE [slots] in fused_norm.py) add the same way."""
        if const_expr(slot == 0):
            rH.store(rT.load().to(Float32))
        else:
            rH.store(rH.load() + rT.load().to(Float32))

    @cute.jit
    def round_sum(self, rH, rR, has_residual: cutlass.Constexpr, dtype: cutlass.Constexpr):
        """rH: float32 sum (fold) -> float(h), h = T(acc + float(res)) (one rounding) or T(acc)."""
        if const_expr(has_residual):
            rH.store((rH.load() + rR.load().to(Float32)).to(dtype).to(Float32))
        else:
            rH.store(rH.load().to(dtype).to(Float32))

    @cute.jit
    def widen(self, dst, src):
        """dst (float32 fragment) <- src (16-bit fragment of the same size), read as packed words
        (word_values). fp16 is read as words too, never through the fragment's fp16 view:
        add_packed writes the fragment as words, and reading it through both views was miscompiled
        (measured on H200, CuTe DSL 4.3.5: fp16, 8 vectors per thread, rows split over 4 CTAs:
        part 1 stored vector column 0's residual in column 1)."""
        words = cute.recast_tensor(src, Int32)
        half = half_name(src.element_type)
        for i in cutlass.range_constexpr(cute.size(src) // 2):
            dst[2 * i], dst[2 * i + 1] = self.word_values(words[i], half)

    @staticmethod
    def word_values(word: Int32, half: str):
        """The float32 values (low half, high half) of a word of two packed 16-bit floats (`half`:
        "bf16" or "f16"), exact. bf16 is the high half of a float32, so each takes one shift or one
        mask (the generic conversion first moves the high half down with a byte permute: three
        instructions per pair instead of two)."""
        if half == "bf16":
            return ptx.bits_f32(word << 16), ptx.bits_f32(word & Int32(-65536))
        return ptx.f16_to_f32(word, False), ptx.f16_to_f32(word, True)

    def zero_words(self):
        """A zero-filled int32 fragment holding this thread's vectors of one 16-bit row as packed
        words (load_row16)."""
        frag = cute.make_rmem_tensor(cute.make_layout(self.t.vecs_per_thread * VEC // 2), Int32)
        frag.fill(0)
        return frag

    def load_row16(self, dst, mRow, lane: Int32):
        """dst (zero_words) <- row thread `lane`'s vectors of the 16-bit row mRow, moved as packed
        words: a fragment that is read and written as words only (NOTE in widen)."""
        self._copy_row(dst, cute.zipped_divide(cute.recast_tensor(mRow, Int32), (VEC // 2,)), lane,
                       False, None, VEC // 2)

    def store_row16(self, src, mRow, lane: Int32, part=None):
        """Row thread `lane`'s vectors of the 16-bit row mRow <- src (a fragment of the row's
        dtype), moved as packed words: no per-element conversion or repacking."""
        self._copy_row(cute.recast_tensor(src, Int32),
                       cute.zipped_divide(cute.recast_tensor(mRow, Int32), (VEC // 2,)), lane, True,
                       Int32, VEC // 2, part)

    # ---- reductions ----------------------------------------------------------------------------
    # NOTE [short chains]
    # A thread's sum of squares over its nv vectors was one chain of nv * 8 dependent FMAs (64 at
    # H = 32768: ~256 cycles of latency on the decode path, where nothing else hides it). Now one
    # chain per element position e (vector 0's e, then vector 1's e, ...: nv long), and the 8
    # position sums added pairwise (0+1, 2+3, ..., then those): depth nv + 3. A fixed order of
    # float32 operations like before, the same in every kernel (NOTE [batch invariance]); the bits
    # of rstd may differ from the single chain's. A block's amax is a tree over its vector's 8
    # values (a max is exact in any order: same bits). Measured on H200 (benchmarks/results/
    # short_chains_ab_h200.md): M = 1 0.03-0.09 us faster, NVFP4 at H = 16384 8-9% and per-group
    # FP8 3% faster at 1024-4096 rows. Left as chains, because a tree there cost more than it
    # saved: the per-token amax (split, it kept more of y's registers live: ptxas 64 -> 66 at
    # H = 8192, one 512-thread CTA per SM instead of 2) and the row's warp partials (a tree made
    # per-token FP8 at 1024-4096 x 16384 3% slower, for at most ~15 ns at M = 1). The all-reduce
    # kernels' register counts moved both ways (ptxas -v, sm_90a, the 22 fingerprinted variants:
    # 78-214, two spilling variants no longer spill); their grids keep 256 threads per SM whatever
    # the count (compile_allreduce.co_resident_ctas_per_sm), so occupancy does not change.
    def thread_sum_of_squares(self, rH) -> Float32:
        """This thread's sum of h^2 over its vectors, in the order of NOTE [short chains]."""
        sums = []
        for e in range(VEC):
            acc = rH[e] * rH[e]
            for j in range(1, self.t.vecs_per_thread):
                acc = acc + rH[j * VEC + e] * rH[j * VEC + e]
            sums.append(acc)
        return pairwise(lambda a, b: a + b, sums)

    @cute.jit
    def row_reduce(self, val: Float32, is_max: cutlass.Constexpr, bufs, row_in_cta: Int32,
                   lane: Int32) -> Float32:
        """Reduce `val` over the whole row: warp butterflies, then the row's warp partials in warp
        order (all CTAs of a cluster add all of them: NOTE [batch invariance])."""
        t = self.t
        op = ptx.fmax_nan if const_expr(is_max) else (lambda a, b: a + b)
        warp_buf, cta_buf, mbar = bufs
        val = cute.arch.warp_reduction(val, op, threads_in_group=min(32, t.threads_per_row))
        if const_expr(t.cluster_n > 1):  # NOTE [cluster exchange]
            mbar_addr = ptx.smem_ptr_u32(mbar.iterator)
            if lane % 32 == 0:
                addr = ptx.smem_ptr_u32((cta_buf.iterator + cta_buf.layout((row_in_cta, lane // 32))))
                for c in cutlass.range_constexpr(t.cluster_n):
                    ptx.st_async_cluster_f32(addr, mbar_addr, Int32(c), val)
            landed = ptx.mbarrier_try_wait(mbar_addr, Int32(0))
            while landed == Int32(0):
                landed = ptx.mbarrier_try_wait(mbar_addr, Int32(0))
            val = cta_buf[row_in_cta, 0]
            for w in cutlass.range_constexpr(1, t.row_warps):
                val = op(val, cta_buf[row_in_cta, w])
        elif const_expr(t.warps_per_row > 1):
            if lane % 32 == 0:
                warp_buf[row_in_cta, lane // 32] = val
            cute.arch.barrier()
            val = warp_buf[row_in_cta, 0]
            for w in cutlass.range_constexpr(1, t.warps_per_row):
                val = op(val, warp_buf[row_in_cta, w])
        return val

    # ---- packing -------------------------------------------------------------------------------
    @cute.jit
    def _e2m1_biased_magnitude(self, v: Float32) -> Int32:
        """The e2m1 magnitude code of v (formats.e2m1_codes without the sign: RNE, ties to even,
        saturate at 6, NaN -> 0) plus E2M1_CODE_BIAS.

        Hopper has no e2m1 convert. With c = |v| clamped to [0, 6] (NaN -> 0, which makes the
        saturation and NaN cases free), one float32 add does the rounding: e2m1's step is 0.5
        below 2, 1 in [2, 4) and 2 in [4, 6], the ulp of M = 2^22, 2^23, 2^24, so M + c rounds c
        to its step exactly once, ties to even, and its low bits count the steps k; the code is
        k plus 0, 2, 4 for those three ranges (= 2 * exponent of max(c, 1)). The constant part
        (E2M1_CODE_BIAS) is left in: packing is a sum of shifted codes, so the caller removes it
        once per word. Checked against e2m1_codes for every float32 in [0, 6]
        (tests/test_kernel_arithmetic.py checks the same arithmetic on the interesting ranges).
        """
        c = ptx.e2m1_clamp(v)  # |v| in [0, 6], NaN -> 0
        b = ptx.f32_bits(c)
        if b < 0x3F800000:
            b = Int32(0x3F800000)
        binade = b & 0x7F800000  # the exponent of max(c, 1)
        rounded = ptx.f32_bits(ptx.bits_f32(binade + 0x0B000000) + c)  # + 2^(22 + exponent)
        # steps + 2 * exponent + E2M1_CODE_BIAS = rounded - magic + (binade >> 22)
        return rounded - binade + (binade >> 22)

    @cute.jit
    def _store_q(self, rY, j: cutlass.Constexpr, inv: Float32, tQ, vidx: Int32):
        """Quantize the 8 values of vector j (scaled by inv) and store them as int32 words."""
        if const_expr(self.q.packed_fp4):
            scaled = []
            for e in cutlass.range_constexpr(VEC):
                scaled.append(rY[j * VEC + e] * inv)
            word = Int32(0)
            for e in cutlass.range_constexpr(VEC):
                # + instead of |: a sum of shifted biased codes (one IMAD each), the biases
                # removed once below; the magnitudes (< 8) then fill bits 0-2 of each nibble
                word = word + (self._e2m1_biased_magnitude(scaled[e]) << (4 * e))
            tQ[vidx] = (word - Int32(PACKED_E2M1_BIAS)) | ptx.nibble_signs(scaled)
        else:
            rW = cute.make_rmem_tensor(cute.make_layout(2), Int32)
            for w in cutlass.range_constexpr(2):
                b = 4 * w
                lo = ptx.e4m3x2(rY[j * VEC + b + 1] * inv, rY[j * VEC + b] * inv)
                hi = ptx.e4m3x2(rY[j * VEC + b + 3] * inv, rY[j * VEC + b + 2] * inv)
                rW[w] = lo | (hi << 16)
            tQ[(None, vidx)].store(rW.load())

    @cute.jit
    def _store_scale(self, mS, row: Int32, blk: Int32, value: Float32, offset=None):
        """Scale of (row, block): float32 for per-token / per-group; else one byte (the e4m3 or
        e8m0 code carried in `value`) through a uint8 recast of mS (nvfp4's is float8_e4m3fn),
        addressed by the 128x4 layout when swizzled (at `offset` when the caller has it)."""
        if const_expr(self.q.float_scales):
            mS[row, blk] = value
        elif const_expr(self.q.swizzled):
            flat = cute.make_tensor(cute.recast_ptr(mS.iterator, dtype=cutlass.Uint8),
                                    cute.make_layout(mS.shape[0] * mS.shape[1]))
            if const_expr(offset is None):
                offset = swizzled_offset(row, blk, self.t.hidden // self.q.group_size)
            flat[offset] = cutlass.Uint8(Int32(value))
        else:
            cute.recast_tensor(mS, cutlass.Uint8)[row, blk] = cutlass.Uint8(Int32(value))

    # ---- the epilogue --------------------------------------------------------------------------
    @cute.jit
    def load_weight(self, mW, lane: Int32, cols=None):
        """Row thread `lane`'s vectors of the weight [H] (those of `cols`, part_columns: default
        all) as a register fragment of its dtype."""
        if const_expr(cols is None):
            cols = self.part_columns(None)
        rW = self.zeros(mW.element_type, len(cols))
        self._copy_row(rW, cute.zipped_divide(mW, (VEC,)), lane, False, None, VEC, None, cols)
        return rW

    def y_part(self, part):
        """The part whose y vectors a split part makes (NOTE [compact parts]): its own, or None
        (every vector) where the row amax needs every y (per-token scales)."""
        return None if self.q.info.scales == "row" else part

    def weight_columns(self, part) -> list:
        """The vector columns whose weights the epilogue multiplies y by (load_weight's `cols`)."""
        return self.part_columns(self.y_part(part))

    @cute.jit
    def epilogue(self, rH, row: Int32, row_valid, scale_valid, lane: Int32, row_in_cta: Int32,
                 eps: Float32, mW, mY, mQ, mS, static_scale: Float32, global_scale: Float32, bufs,
                 rW=None, part=None, scale_row=None):
        """rH: float32 register fragment [vecs_per_thread * 8] of h for row thread `lane`'s
        vectors (lane: the thread's index among the row's row_threads, cluster-wide).
        rW: this thread's weight vectors of weight_columns(part) (load_weight), when the caller
        loaded them early (NOTE [weights with the row loads] in fused_norm.py); else they are
        loaded here.

        static_scale, global_scale: load_scalars's (the static scale as loaded).
        Writes T(y) to mY (when write_y), q to mQ (as int32 words) and scales to mS. Threads of padded
        rows (row_valid False, scale_valid True: swizzled-scale padding) compute on zeros and store
        only scales; threads past both store nothing.
        All threads of the CTA must call this (it synchronizes).
        part: this CTA's part of a split row (NOTE [split rows]); None: it stores everything.
        scale_row: the row of mS that holds this row's block scales (default `row`: a gathered
        output's rows sit elsewhere, NOTE [swizzled scales gathered] in kernels/reducescatter.py).
        """
        t = self.t
        # a split part makes only its own vectors' y (NOTE [compact parts]), but every y when the
        # row amax needs it (compacted after the amax)
        y_part = self.y_part(part)
        cols = self.part_columns(y_part)
        if const_expr(rW is None):
            # issued before the reduction so its latency hides behind it (matters at M=1)
            rW = self.load_weight(mW, lane, cols)
        # sum of squares (tail vectors of a ragged row hold zeros): NOTE [short chains]
        ss = self.thread_sum_of_squares(rH)
        ss = self.row_reduce(ss, False, bufs[0], row_in_cta, lane)
        r = ptx.rsqrt_rn(ptx.div_rn(ss, Float32(t.hidden)) + eps)
        # y = (h * r) * w, kept in registers (reusing rH, or the part's compact fragment)
        rY = self.compact_part(rH, y_part)
        w = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        for k in cutlass.range_constexpr(len(cols)):
            self.widen(w, self._slice(rW, k))
            for e in cutlass.range_constexpr(VEC):
                wf = w[e]
                if const_expr(self.gemma):
                    wf = Float32(1.0) + wf
                rY[k * VEC + e] = (rY[k * VEC + e] * r) * wf
        row_amax = None
        if const_expr(y_part is None and part is not None and self.split > 1):
            # a split row's per-token amax needs every y; the part then keeps its own columns
            # (NOTE [compact parts]: its stores behind a branch per vector were miscompiled)
            row_amax = self._row_amax(rY, cols, bufs, row_in_cta, lane)
            rY = self.compact_part(rY, part)
            cols = self.part_columns(part)
        if const_expr(self.write_y):
            if row_valid:
                self.store_row(rY, cute.zipped_divide(mY[row, None], (VEC,)), lane, mY.element_type,
                               None, cols)
        if const_expr(self.q.info.scales != "none"):
            self._quantize(rY, cols, row, row_valid, scale_valid, lane, row_in_cta, mQ, mS,
                           static_scale, global_scale, bufs, part, row_amax, scale_row)

    @cute.jit
    def _row_amax(self, rY, cols: list, bufs, row_in_cta: Int32, lane: Int32) -> Float32:
        """max |y| over the row (per-token scales): this thread's y vectors rY (columns `cols`),
        one chain (NOTE [short chains]), then over the row's threads."""
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(len(cols) * VEC):
            amax = ptx.fmax_nan(amax, ptx.fabs(rY[i]))
        return self.row_reduce(amax, True, bufs[1], row_in_cta, lane)

    def _slice(self, rH, j: int, width: int = VEC):
        """The register view of vector j (`width` elements: 8 values, or 4 packed words)."""
        return cute.make_tensor(rH.iterator + j * width, cute.make_layout(width))

    @cute.jit
    def _quantize(self, rY, cols: list, row: Int32, row_valid, scale_valid, lane: Int32,
                  row_in_cta: Int32, mQ, mS, static_scale: Float32, global_scale: Float32, bufs,
                  part=None, row_amax=None, scale_row=None):
        """q and scales of the y vectors rY of columns `cols` (part_columns). row_amax: the
        per-token amax when the caller reduced it already (a split row: epilogue); scale_row:
        the block scales' row of mS (epilogue)."""
        t = self.t
        q = self.q
        srow = row if scale_row is None else scale_row
        # the row as int32 words (4 fp8 codes or 8 fp4 codes each; the host passes q unviewed)
        tQ = cute.recast_tensor(mQ[row, None], Int32)
        if const_expr(not q.packed_fp4):
            tQ = cute.zipped_divide(tQ, (2,))
        rcp_gs = Float32(0.0)
        if const_expr(q.kind == "nvfp4"):
            rcp_gs = ptx.rcp_rn(global_scale)  # once per row, not per block
        if const_expr(q.info.scales == "static"):
            # NOTE [scalars after the row loads]
            self._store_q_columns(rY, cols, ptx.rcp_rn(static_scale), tQ, lane, row_valid)
        elif const_expr(q.info.scales == "row"):
            amax = row_amax
            if const_expr(row_amax is None):
                amax = self._row_amax(rY, cols, bufs, row_in_cta, lane)
            stored, inv = self._block_scale(amax, global_scale, rcp_gs)
            if lane == 0 and row_valid and self._mine(0, part):
                self._store_scale(mS, row, Int32(0), stored)
            self._store_q_columns(rY, cols, inv, tQ, lane, row_valid)
        else:  # blocked formats: a block is `lanes` consecutive lanes of one vector column j
            lanes = q.group_size // VEC
            group = self._scale_group(lanes, len(cols))
            # swizzled: when a vector column's blocks fill whole 4-block runs, vector j's scale sits
            # a fixed distance from vector 0's (swizzled_offset is linear in blk >> 2 and keeps
            # blk & 3), so the offset is computed once per row, not once per vector
            runs_per_column = t.row_threads // lanes // 4 if (t.row_threads // lanes) % 4 == 0 else 0
            offset0 = None
            if const_expr(q.swizzled and runs_per_column > 0):
                offset0 = swizzled_offset(srow, lane // lanes, t.hidden // q.group_size)
            for g in cutlass.range_constexpr(len(cols) // group):
                k0 = g * group
                # NOTE [one scale per lane] in block_scales.py
                amax = self._block_amax(rY, k0, group, lanes, lane)
                stored, inv = self._block_scale(amax, global_scale, rcp_gs)
                for i in cutlass.range_constexpr(group):
                    # names unused elsewhere in this function: CuTe DSL types a name per function
                    kb = k0 + i
                    vk = lane + cols[kb] * t.row_threads
                    inv_k = self._lane_value(inv, i, group, lane)
                    if const_expr(self._columns_exact(cols)) or vk < t.vecs:
                        blk = vk // lanes
                        if lane % lanes == i and scale_valid:
                            offset = None
                            if const_expr(offset0 is not None):
                                offset = offset0 + cols[kb] * runs_per_column * 512
                            self._store_scale(mS, srow, blk, stored, offset)
                        if row_valid:
                            self._store_q(rY, kb, inv_k, tQ, vk)
            if const_expr(q.swizzled):
                if lane == 0 and scale_valid and self._mine(0, part):
                    self._zero_padding_columns(mS, srow)

    @cute.jit
    def _store_q_columns(self, rY, cols: list, inv: Float32, tQ, lane: Int32, row_valid):
        """q of every vector of rY (columns `cols`: a split part's are its own) scaled by one
        multiplier (static / per-token scales)."""
        t = self.t
        for k in cutlass.range_constexpr(len(cols)):
            v = lane + cols[k] * t.row_threads
            if const_expr(self._columns_exact(cols)) or v < t.vecs:
                if row_valid:
                    self._store_q(rY, k, inv, tQ, v)

    @cute.jit
    def _zero_padding_columns(self, mS, row: Int32):
        """Zero row `row`'s padding columns of the 128x4 scale layout (K rounded up to 4)."""
        k = self.t.hidden // self.q.group_size
        for c in cutlass.range_constexpr(k, (k + 3) // 4 * 4):
            self._store_scale(mS, row, Int32(c), Float32(0.0))

    @cute.jit
    def store_padding_scales(self, mS, m: Int32, first_word: Int32, tid: Int32, threads: int,
                             per_thread: int):
        """Zero scales for the padding rows m .. round_up(m, 128) - 1 of the swizzled layout (what
        the epilogue would compute from y = 0), words first_word + i * threads + tid (i <
        per_thread) of the last, partial tile (its words in memory order: a warp's stores are 128
        contiguous bytes). A word holds one row's 4 blocks (formats.swizzled_word_row), so words of
        real rows are skipped whole and no byte is shared (rows past m in the last row block also
        get zeros from the epilogue: the same value). No synchronization."""
        tile_words = swizzled_tile_words(self.t.hidden // self.q.group_size)
        words = cute.make_tensor(cute.recast_ptr(mS.iterator, dtype=Int32),
                                 cute.make_layout(mS.shape[0] * mS.shape[1] // 4))
        base = (m // 128) * tile_words  # the last, partial tile's first word
        for i in cutlass.range_constexpr(per_thread):
            w = first_word + i * threads + tid
            if w < tile_words:
                if swizzled_word_row(w) >= m % 128:
                    words[base + w] = Int32(0)

    @cute.jit
    def store_padding_words(self, mS, m: Int32, first: Int32, step: Int32):
        """store_padding_scales as a grid-stride loop over the 16-byte units first, first + step,
        ... of the last, partial tile (none when m fills whole tiles); mS starts 16-byte aligned
        (the ops check a given scales_out; a tile is a multiple of 512 bytes). Unit u holds word j
        of row j * 32 + u % 32 (formats.swizzled_word_row of word 4u + j), so a unit whose first
        row is a padding row is stored whole, one that also holds real rows word by word, and at
        one row a thread stores a quarter of the words one at a time would take (NOTE [padding
        words] in kernels/allreduce.py)."""
        tile_words = swizzled_tile_words(self.t.hidden // self.q.group_size)
        real = m % 128
        if real != 0:
            base = mS.iterator.toint() + Int64(m // 128) * Int64(tile_words * 4)
            for u in range(first, tile_words // 4, step):
                r = u & Int32(31)
                unit = base + Int64(u) * Int64(16)
                if r >= real:
                    st_weak_v4_u32(unit, Int32(0), Int32(0), Int32(0), Int32(0))
                elif r + Int32(96) >= real:
                    for j in cutlass.range_constexpr(1, 4):  # word 0 is row r's: real
                        if r + Int32(32 * j) >= real:
                            st_weak_u32(unit + Int64(4 * j), Int32(0))
