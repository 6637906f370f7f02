"""The sequence-parallel reduce-scatter ("reducescatter", and "rsgather", which also gathers q in
its epilogue): the bodies ``ReduceScatter._reducescatter`` and its helpers, a part of the kernel
class ``AllReduceAddRMSNormQuant`` (kernels/allreduce.py) that reuses two-shot's push
(``TwoShot._push_slices``, kernels/twoshot.py).

"reducescatter" (the sequence-parallel op, collectives/seqpar.py): two-shot's phase 1 over slices
of S = ceil(M / N) unpadded rows, then phase 2 for my slice only, writing shard-local
outputs (rows 0..M_r-1 of residual_out, y, q, scales; the scale padding of the shard's last
tile zeroed by words, NOTE [padding words]); final cta_barrier. Buffer: scatter [N][S][H] T.

NOTE [reduce-scatter rounds]: in the "serial" form (the default) a CTA pushes all its row groups,
meets its peers once, then reduces and finishes its rows: the link idles while the epilogue
runs (by byte count about 600 MB of local HBM traffic against 134 MB pushed at 16384 x 8192 on
2 ranks: ~140 us of the 530 measured, benchmarks/results/seqpar_h200_x2.md). The "pipelined" form cuts
a CTA's row groups into rounds with a barrier after each round's push, and pushes
round r + 1 before it finishes round r, so the epilogue runs while the next rows cross the
link. The rounds per CTA are the form's (RS_FORM_ROUNDS): "pipelined" up to 4, "pipelined-8" up to
8 (2 x H200: gathered NVFP4 3.1-4.7 % faster than 4 rounds from 8192 rows, FP8 0.8-2.3 % from 128
MiB but 2.5 % slower at 8192 x 4096; 4 x H200: 1.8-11 % slower than 4 rounds; benchmarks/results/
rs_rounds8_ab_h200_x{2,4}.md; likely, not timed apart: at 4 ranks a round's barrier waits on three
peers and costs more than the round hides), "pipelined-16" and "pipelined-32" up to 16 and 32
(packed FP4 at 2 ranks is fastest with about two row groups per round, 1-byte codes with about
four; a round of one row group is much slower: collectives/plan.py's ladder notes), and
"pipelined-2" up to 2 (in no ladder: for 2048-row calls, where a CTA has 4-8 row groups and
"pipelined" cuts them into rounds of one or two; it won nowhere). "pipelined-g2" and "pipelined-g4"
say the rule directly: rounds of at most 2 or 4 row groups, as many as that takes; at 2 ranks they
pick, row for row, the fastest forced form of every measured gathered call from 8192 rows (g2 for
packed FP4, g4 for 1-byte codes), and the 2-rank packed-FP4 ladder takes g4 at 16 MiB and g2 at
32 MiB (2048-row calls; collectives/plan.py). Every
rank's same-index CTA has the same groups (push_groups, grid and index agree: the signature says
so), hence the same rounds and barriers. A round only reads slot rows its peers
pushed before that round's barrier, and the rows of round r + 1 are others, so no read meets a
write; the final barrier keeps the next call's pushes off rows still read, as before. The same
float32 operations per row, so the same bits as "serial".

NOTE [bulk-copy pushes]: "pipelined-tma" (in no ladder: an A/B candidate for 2048-row calls,
issue 13, docs/SEQPAR_HISTORY.md "The next lever") keeps the pipelined rounds and their barriers
and moves only the x pushes to the TMA (kernels/bulkpush.py): with thread stores a round costs
its push's drain plus its finishing plus a barrier, since a thread that stores cannot finish rows
until its stores leave; a bulk copy leaves the threads free, so a round costs the larger of drain
and finishing plus a barrier. Right after barrier r - 1, thread 0 issues round r's copies (shared
memory -> slot `rank` of each peer, a bulk group per (row group, peer)) from a stage that bulk
loads (x -> shared memory) filled during round r - 1, then issues round r + 1's loads into the
other stage; the CTA finishes round r - 1 while they drain. Right before barrier r, thread 0 waits
for the round's writes (cp.async.bulk.wait_group 0) and fences the async proxy against the generic
one (fence.proxy.async): the barrier's flags are generic st.release.sys stores, cumulative over
what their threads observed through bar.sync, and the fence orders the async writes, complete for
thread 0, before thread 0's arrival there; so the peer's acquire covers them as it covers thread
stores. A fence after each stage's mbarrier wait orders the acquire of the previous barrier (the
peers' reads of the rows that the copies overwrite came before it) and the landed stage before the
copies. Two stages, so a round's loads never write the stage its stores read: round r + 1's stage
held round r - 1, whose writes were waited for before barrier r - 1. Each stage's mbarrier
completes one phase per load (round r: stage and mbarrier r % 2, parity (r // 2) % 2), with one
arrival that expects all the round's bytes; every load is waited for, also after a failed barrier
(which stores nothing more), so no copy into shared memory outlives the CTA. A stage holds a whole
round, every row group's rows for every peer, since thread 0 cannot feed a stage during the
round's epilogue (its CTA barriers need it): rounds of at most two row groups (pipelined-g2's),
one where a stage holds only one, both stages within 48 KiB of shared memory, and within 96 KiB
for all the CTAs the grid cap puts on one SM (two of 128 threads, four of 64): the barriers need
the whole grid resident. Where not even one row group fits, or a row is not whole 16-byte units,
the form is pipelined-g2 with thread stores (a compile-time choice: bulkpush's
bulk_round_groups). A rank whose x rows are strided (a run-time property, not in the descriptor)
pushes with thread stores in the same rounds, since the ranks' rounds and barriers must agree.
The same rows land in the same slots: the same bits as "serial".

The form "roles-tma" (in no ladder, issue 13's larger lever) has no rounds and no barriers: pusher
CTAs push x by TMA bulk copies, finisher CTAs run _shard_group as the rows land, flags and counts in
the signal pads order them (NOTE [reduce-scatter roles by TMA] in kernels/rolespush.py); where its
stages do not fit it is "serial".

NOTE [gather in the epilogue]: algorithm "rsgather" is "reducescatter" (either form) that also
gathers q for the sequence-parallel op's gather=True: right after a row group's epilogue wrote
its q rows (into my rows of the full q tensor: the host passes them as a view of it), the CTA
reads them back (its own stores, ordered by the epilogue's CTA barrier) and pushes them into
row rank * S + i of every peer's q area, the upper half of its buffer (table entries N + s);
after the final barrier it copies the other shards' rows from its own q area into the full q.
So q crosses NVLink while the other row groups are still reduced and finished, instead of in a
row-gather launch after this kernel (the reduce-scatter leaves the link idle during its
epilogue). Safe: the pushes come after the first barrier, so before them every peer has ended
its previous kernel; a peer's next call writes my upper half only after its own first barrier,
which needs this kernel to have ended; and the copy-out reads only rows that same-index CTAs
pushed before the final barrier (every rank's CTA b finishes the same row groups of its own
shard). Scales whose rows are whole 4-byte units in a row-major linear layout
(formats.pushed_scale_row_bytes; per-token FP8, NVFP4 when H is a multiple of 64) go the same
way, into the q area after its N * S q rows, and are copied out with q (the host lays them
out afterwards: NOTE [gathered scales] in collectives/seqpar.py); other scales and y are
gathered after the kernel. Same bytes as the row gather: bitwise. The copies' loads go before
their stores (NOTE [batched copies]).

NOTE [swizzled scales gathered]: 128x4-swizzled block scales whose rows are whole 4-byte words
(formats.pushed_scale_row_bytes) go the same way (Tuning.gather_by "epilogue-swizzled", the
default), and the kernel lays them out itself: its scales tensor is the full output (M rows'
tiles, not the shard's rows), the epilogue writes row i's scales at row rank * S + i (its
scale_row), the push reads each of my rows back word by word (a row's blocks 4b .. 4b + 3 are one
word) and sends it as a linear row, the copy-out stores each word of the other shards' linear rows
at its swizzled place, and every rank zeroes the padding words of rows M .. round_up(M, 128) of
its own full output (NOTE [padding words]). Shards need not be whole tiles: every store names its
global row, and a word holds one row's blocks, so no two writers share one. The host then has
nothing to lay out: under "epilogue" the scales go linear and a permuted copy follows the kernel
(formats.swizzle_into: 2.4 us at 2048 x 256 scales, 4.9 at 8192 x 256, 7.9 at 16384 x 256 on one
H200; benchmarks/results/swizzle_into_h200.md). Same bytes, the same places: bitwise. The words
are read with weak loads (a word holds one row's blocks, all stored by this CTA's epilogue before
its barrier: the plain write / __syncthreads / read pattern) and stored with weak stores (read
after the kernel). With volatile ones the kernel lost ~0.035 us per KiB of the shard's scales,
about one L2 round trip per 4-byte warp access (2 x H200, gathered NVFP4 2048 x 8192: 102.6 us
against the linear path's 86.3, benchmarks/results/seqpar_swz_h200_x2.md); with weak ones it is at
par or faster at 7 of 8 shapes (84.4 against 86.6 there, 144.6 against 150.3 at 8192 x 4096; 0.6
us slower at 2048 x 4096: seqpar_weak_ab_h200_x2.md).

NOTE [weak gather copies]: the gather's copies use weak loads and stores where nothing needs
them stronger: the push reads my own q and scale rows, stored by this CTA's epilogue before its
barrier (the plain write / barrier / read pattern), and stores them into the peers' q areas,
which the peers read only after a barrier whose release orders every earlier store (as
two-shot's pushes of x); the copy-out stores into my own outputs, read after the kernel. Its
loads of the peers' rows stay volatile: a weak load could find a line cached by an earlier
round's read (32 per-token scale rows share a line). Measured on 2 x H200 against the same
copies volatile (seqpar_weak_ab_h200_x2.md, one round): every gathered cell 0.2-2 % faster (FP8
2048 x 4096 46.0 against 46.3 us, NVFP4 8192 x 4096 150.3 against 152.7).

NOTE [copy-out by rounds]: the pipelined form copies round r's gathered rows out right after the
barrier that follows round r (it orders every peer's q pushes of the round before it), while the
peers' later rounds still cross the link; only the last round's rows wait for the final barrier.
Measured on 2 x H200 (benchmarks/results/copy_rounds_ab_h200_x2.md, against the copy after the
final barrier): gathered FP8 pipelined 8192 x 8192 316.5 -> 303.8 us, 16384 x 8192 625.7 -> 602.0,
NVFP4 1.2-1.6% faster at every size. The serial form has no barrier between rounds; giving it
per-CTA arrival counts (peer s's CTA b sets arrived[s][b] in my signal pad with st.release.sys after
each round's q rows, I copy round r - 1 out after round r) made it slower at every size (2048 x
4096 FP8 46.0 -> 57.4 us, 8192 x 8192 313.5 -> 316.9), most likely because each release after a
round's remote stores holds the CTA until they are acknowledged (a few us per round, not timed
apart). Not kept; the sized forms' ladder (collectives/plan.py) sends large gathered calls to the
pipelined form instead.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.formats import swizzled_offset
from distnorm.kernels.bulkpush import BulkPushes
from distnorm.kernels.compat import SmemAllocator
from distnorm.kernels.rolespush import RolesPushes
from distnorm.kernels.sync import (ld_volatile_sys_u32, ld_volatile_sys_v4_u32, ld_weak_u32,
                                  ld_weak_v4_u32, st_weak_u32, st_weak_v4_u32)

__all__ = ["ReduceScatter", "RS_FORM_ROUNDS", "RS_ALGOS", "COPY_BATCH"]

# the sequence-parallel reduce-scatter, and the same with q gathered in its epilogue
RS_ALGOS = ("reducescatter", "rsgather")

# NOTE [reduce-scatter rounds]: the most rounds a CTA's row groups are cut into, per form ("serial":
# one), or (negative) the most row groups per round; each round costs one more cross-rank barrier
# (a few us of NVLink latency per CTA)
RS_FORM_ROUNDS = {"serial": 1, "pipelined": 4, "pipelined-8": 8, "pipelined-16": 16,
                  "pipelined-32": 32, "pipelined-2": 2, "pipelined-g2": -2, "pipelined-g4": -4,
                  # NOTE [bulk-copy pushes]: -1 where a stage holds one row group only
                  "pipelined-tma": -2,
                  # NOTE [reduce-scatter roles by TMA]: no rounds ("serial" where it cannot run)
                  "roles-tma": 1}

# NOTE [batched copies]: the epilogue gather's copies (q and scale rows to the peers, then the
# other shards' rows out of my q area) issue all of a batch's loads before its stores: a store
# waits for its load, and in-order issue would otherwise pay one load latency per unit. The
# copy-out batches the rows of COPY_BATCH shards (registers: 4 per 16-byte unit in flight).
COPY_BATCH = 4


def _unit_store(addr: Int64, val: tuple) -> None:
    """Store one loaded unit (4 words: 16 bytes, 1 word: 4 bytes) at addr, weakly (NOTE [weak
    gather copies]: every store of the gather's copies is read after a barrier or the kernel)."""
    if len(val) == 4:
        st_weak_v4_u32(addr, *val)
    else:
        st_weak_u32(addr, val[0])


class ReduceScatter(BulkPushes, RolesPushes):
    """The reduce-scatter algorithms of AllReduceAddRMSNormQuant (which provides self.t, self.core,
    self.world, self.rs_rounds, self.gather_q, self.gather_scales, self.gather_swizzled,
    self.q_row_bytes, self.s_row_bytes, self.bulk_groups, two-shot's _push_slices and the helpers of
    kernels/allreduce.py; its TMA pushes come from BulkPushes, kernels/bulkpush.py)."""

    @cute.jit
    def _reducescatter(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                       rank: Int32, eps: Float32, timeout: Int64, rows: Int32, slice_rows: Int32,
                       groups: Int32, own_pad: Int64):
        """Sequence-parallel form: two-shot's reduce-scatter, then the epilogue of my shard only,
        into shard-local outputs (residual, y, q, scales have the shard's rows; `rows`: the shard's
        rows of the scale layout). No gather: collectives/seqpar.py gathers q and scales."""
        t = self.t
        dtype = mX.element_type
        tidx, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        slot_elems = Int64(slice_rows) * hidden
        local = m - rank * slice_rows  # rows of my shard
        if local > slice_rows:
            local = slice_rows
        if const_expr(self.q.swizzled):  # NOTE [padding words] in kernels/allreduce.py
            pad_from = local  # a trailing rank's shard may be empty (local <= 0)
            if pad_from < Int32(0):
                pad_from = Int32(0)
            if const_expr(self.gather_swizzled):  # NOTE [swizzled scales gathered]: the full
                pad_from = m  # output's padding rows
            self.core.store_padding_words(mS, pad_from, bidx * Int32(t.threads) + tidx,
                                          nblk * Int32(t.threads))
        smem = None  # NOTE [bulk-copy pushes]: the stages come from the epilogue's allocator
        if const_expr(self.bulk_groups > 0 or self.roles_pushers > 0):
            smem = SmemAllocator()
        bufs, rT, rR, rH, static_scale, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane, smem)
        may_push = self._may_push(own_pad)
        sig = self._describe_launch(own_pad, m)
        push_groups = (slice_rows + t.rows_per_cta - 1) // t.rows_per_cta
        q_base = Int64(0)  # my row 0 of the full q (NOTE [gather in the epilogue])
        s_base = Int64(0)  # and of the full scales, when they go with q
        if const_expr(self.gather_q):
            q_base = mQ.iterator.toint()
        if const_expr(self.gather_scales):
            s_base = mS.iterator.toint()
        copy_from = bidx  # this CTA's row groups from here on are copied out after the final barrier
        if const_expr(self.roles_pushers > 0):  # NOTE [reduce-scatter roles by TMA]
            base = mBuf[rank]
            self._roles_reducescatter(
                mX, mBuf, mSig, mErr, rank, timeout, slice_rows, groups, sig, may_push, smem,
                (local, rows, base, slot_elems, slice_rows, rank, row_in_cta, lane, eps, mX, mR,
                 mRout, mAR, mW, mY, mQ, mS, rH, rR, rT, static_scale, global_scale, bufs, rW, dtype,
                 mBuf, q_base, s_base), q_base, s_base, rT, dtype, row_in_cta, lane)
        else:
            if const_expr(self.rs_rounds == 1):
                self._push_slices(mX, mBuf, rank, slice_rows, push_groups, bidx, nblk, row_in_cta,
                                  lane, rT, dtype, may_push)
                failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)

                base = mBuf[rank]
                for g in range(bidx, self._unless_failed(failed, groups), nblk):
                    self._shard_group(g, local, rows, base, slot_elems, slice_rows, rank,
                                      row_in_cta, lane, eps, mX, mR, mRout, mAR, mW, mY, mQ, mS,
                                      rH, rR, rT, static_scale, global_scale, bufs, rW, dtype, mBuf,
                                      q_base, s_base)
            else:
                # NOTE [reduce-scatter rounds]
                # one round's span of g is `step`
                rounds, step, end = self._rounds(bidx, nblk, push_groups, self.rs_rounds)
                tma = None
                if const_expr(self.bulk_groups > 0):  # NOTE [bulk-copy pushes]
                    tma = self._bulk_setup(smem, mX, tidx)
                    self._bulk_round(tma, Int32(0), rounds, Int32(0), mX, mBuf, rank, slice_rows,
                                     push_groups, bidx, nblk, step, row_in_cta, lane, rT, dtype,
                                     may_push)
                    self._bulk_drain(tma)
                else:
                    self._push_slices(mX, mBuf, rank, slice_rows, end, bidx, nblk, row_in_cta, lane,
                                      rT, dtype, may_push)
                failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig)
                base = mBuf[rank]
                for r in range(rounds):
                    g0 = bidx + r * step
                    # the next round's rows leave while this round's are finished
                    if r + 1 < rounds:
                        end = g0 + 2 * step
                        if end > push_groups:
                            end = push_groups
                        if const_expr(self.bulk_groups > 0):
                            self._bulk_round(tma, r + 1, rounds, failed, mX, mBuf, rank, slice_rows,
                                             push_groups, bidx, nblk, step, row_in_cta, lane, rT,
                                             dtype, may_push)
                        else:
                            self._push_slices(mX, mBuf, rank, slice_rows,
                                              self._unless_failed(failed, end), g0 + step, nblk,
                                              row_in_cta, lane, rT, dtype, may_push)
                    end = g0 + step
                    if end > push_groups:
                        end = push_groups
                    for g in range(g0, self._unless_failed(failed, end), nblk):
                        self._shard_group(g, local, rows, base, slot_elems, slice_rows, rank,
                                          row_in_cta, lane, eps, mX, mR, mRout, mAR, mW, mY, mQ,
                                          mS, rH, rR, rT, static_scale, global_scale, bufs, rW,
                                          dtype, mBuf, q_base, s_base)
                    if r + 1 < rounds:
                        if const_expr(self.bulk_groups > 0):
                            self._bulk_drain(tma)  # round r + 1's writes before its barrier
                        failed = self._barrier(mSig, rank, bidx, timeout, mErr, sig) | failed
                        if const_expr(self.gather_q):
                            # NOTE [copy-out by rounds]: the barrier ordered every peer's q
                            # pushes of round r before it
                            self._copy_out_q(mBuf, q_base, s_base, m, slice_rows, rank,
                                             self._unless_failed(failed, end), g0, nblk, row_in_cta,
                                             lane)
                copy_from = bidx + (rounds - 1) * step  # the last round's rows: after the barrier
            # nobody may overwrite a slot (next call) that a peer still reads
            done = self._barrier(mSig, rank, bidx, timeout, mErr, sig)
            if const_expr(self.gather_q):  # NOTE [gather in the epilogue]
                self._copy_out_q(mBuf, q_base, s_base, m, slice_rows, rank,
                                 self._unless_failed(done | failed, groups), copy_from, nblk,
                                 row_in_cta, lane)

    @cute.jit
    def _shard_group(self, g: Int32, local: Int32, rows: Int32, base: Int64, slot_elems: Int64,
                     slice_rows: Int32, rank: Int32, row_in_cta: Int32, lane: Int32, eps: Float32,
                     mX, mR, mRout, mAR, mW, mY, mQ, mS, rH, rR, rT, static_scale, global_scale, bufs,
                     rW, dtype: cutlass.Constexpr, mBuf, q_base: Int64, s_base: Int64):
        """Row group g of my shard: the ordered sum of its slots, the residual add, the epilogue
        into the shard-local outputs (rows < local are real; rows < `rows` have scales); with
        gather_q its q rows (and with gather_scales their scales) then go to every peer (NOTE
        [gather in the epilogue])."""
        i = g * self.t.rows_per_cta + row_in_cta
        row_valid = i < local
        self._reduce_row(rH, rR, rT, mX, mR, mRout, mAR, base, slot_elems, i,
                         rank * slice_rows + i, i, row_valid, rank, lane, dtype)
        scale_valid = i < rows
        scale_row = None
        if const_expr(self.gather_swizzled):
            # NOTE [swizzled scales gathered]: the scales go to their row of the full output
            scale_valid = row_valid
            scale_row = rank * slice_rows + i
        self.core.epilogue(rH, i, row_valid, scale_valid, lane, row_in_cta, eps, mW, mY, mQ, mS,
                           static_scale, global_scale, bufs, rW, None, scale_row)
        cute.arch.barrier()  # shared-memory partials are reused by the next row; q rows visible
        if const_expr(self.gather_q):
            if row_valid:
                # NOTE [batched copies]: every unit of the row's q and scales loaded, then stored
                row = Int64(rank) * Int64(slice_rows) + Int64(i)
                parts = [(q_base + Int64(i) * Int64(self.q_row_bytes),
                          row * Int64(self.q_row_bytes), self.q_row_bytes)]
                if const_expr(self.gather_scales):
                    parts.append((s_base + Int64(i) * Int64(self.s_row_bytes),
                                  self._scale_area(slice_rows) + row * Int64(self.s_row_bytes),
                                  self.s_row_bytes))
                loaded = []
                for p in cutlass.range_constexpr(len(parts)):
                    if const_expr(p == 1 and self.gather_swizzled):
                        # NOTE [swizzled scales gathered]: read word by word
                        loaded.append(self._swizzled_row_loads(s_base, rank * slice_rows + i,
                                                               lane))
                    else:  # my own rows, stored before the barrier above
                        loaded.append(self._unit_loads(parts[p][0], lane, parts[p][2], True))
                for p in cutlass.range_constexpr(len(parts)):
                    unit, units, per_lane = self._units(parts[p][2])
                    for k in cutlass.range_constexpr(per_lane):
                        u = lane + Int32(k * self.t.threads_per_row)
                        if u < Int32(units):
                            for s in cutlass.range_constexpr(self.world):
                                if Int32(s) != rank:
                                    _unit_store(mBuf[self.world + s] + parts[p][1]
                                                + Int64(u) * Int64(unit), loaded[p][k])

    def _swizzled_unit_store(self, full_s: Int64, row: Int32, u: Int32, unit: int,
                             val: tuple) -> None:
        """Store unit u of row `row`'s linear scales (val: its words) word by word at their
        places in the 128x4-swizzled full output at full_s (NOTE [swizzled scales gathered])."""
        for j in range(unit // 4):
            st_weak_u32(self._scale_word_addr(full_s, row, u, unit, j), val[j])

    def _scale_word_addr(self, base: Int64, row: Int32, u: Int32, unit: int, j: int) -> Int64:
        """Address of word j of unit u of row `row`'s linear scales (blocks 4w .. 4w + 3, w = u *
        unit / 4 + j) in the 128x4-swizzled scales at base."""
        w = u * Int32(unit // 4) + Int32(j)
        return base + Int64(swizzled_offset(row, w * Int32(4), self.t.hidden // self.q.group_size))

    def _scale_area(self, slice_rows: Int32) -> Int64:
        """Byte offset of the gathered scale rows in a q area: after the world * S q rows."""
        return Int64(self.world) * Int64(slice_rows) * Int64(self.q_row_bytes)

    def _units(self, row_bytes: int) -> tuple:
        """(unit bytes, units, units per lane) of a row_bytes-byte row: 16-byte units, or 4-byte
        ones for rows of another multiple of 4 (per-token scales); the row's threads take units
        lane, lane + threads_per_row, ..."""
        unit = 16 if row_bytes % 16 == 0 else 4
        units = row_bytes // unit
        return unit, units, -(-units // self.t.threads_per_row)

    def _unit_loads(self, src: Int64, lane: Int32, row_bytes: int, weak: bool = False) -> list:
        """This lane's units of the row at src, all loads issued before any use (NOTE [batched
        copies]); a lane past the row's units loads unit 0 (its store is skipped). Volatile
        loads: they bypass L1, so they see what the peers (the pushes) stored; weak ones for the
        CTA's own rows (NOTE [weak gather copies])."""
        unit = self._units(row_bytes)[0]
        vals = []
        for u in self._lane_units(row_bytes, lane):
            at = src + Int64(u) * Int64(unit)
            if weak:
                vals.append(ld_weak_v4_u32(at) if unit == 16 else (ld_weak_u32(at),))
            else:
                vals.append(ld_volatile_sys_v4_u32(at) if unit == 16 else
                            (ld_volatile_sys_u32(at),))
        return vals

    def _lane_units(self, row_bytes: int, lane: Int32) -> list:
        """The units this lane loads of a row_bytes-byte row: lane, lane + threads_per_row, ...;
        past the row's units, unit 0 (a valid address; the store is skipped)."""
        unit, units, per_lane = self._units(row_bytes)
        lane_units = []
        for k in range(per_lane):
            u = lane + Int32(k * self.t.threads_per_row)
            if units % self.t.threads_per_row:
                u = u * Int32(u < Int32(units))
            lane_units.append(u)
        return lane_units

    def _swizzled_row_loads(self, s_base: Int64, row: Int32, lane: Int32) -> list:
        """_unit_loads of row `row` of the 128x4-swizzled scales at s_base, as its linear row: unit
        u's words are blocks 4w .. 4w + 3 for w = u * words_per_unit + j, each at its
        swizzled_offset (NOTE [swizzled scales gathered])."""
        unit = self._units(self.s_row_bytes)[0]
        return [tuple(ld_weak_u32(self._scale_word_addr(s_base, row, u, unit, j))
                      for j in range(unit // 4))
                for u in self._lane_units(self.s_row_bytes, lane)]

    @cute.jit
    def _copy_out_q(self, mBuf, q_base: Int64, s_base: Int64, m: Int32, slice_rows: Int32,
                    rank: Int32, groups: Int32, bidx: Int32, nblk: Int32, row_in_cta: Int32,
                    lane: Int32):
        """NOTE [gather in the epilogue]: the other shards' q rows (and scale rows) of my row
        groups, from my q area into their rows of the full q (row s * S + i at q_base + ((s -
        rank) * S + i) rows) and of the full scales."""
        own = mBuf[self.world + rank]
        qrb = Int64(self.q_row_bytes)
        srb = Int64(self.s_row_bytes)
        kinds = [(Int64(0), qrb, q_base, self.q_row_bytes)]
        if const_expr(self.gather_scales):
            kinds.append((self._scale_area(slice_rows), srb, s_base, self.s_row_bytes))
        for g in range(bidx, groups, nblk):
            i = g * self.t.rows_per_cta + row_in_cta
            # NOTE [batched copies]: COPY_BATCH shards' rows loaded, then stored
            for s0 in cutlass.range_constexpr(0, self.world, COPY_BATCH):
                oks, dsts, loaded, global_rows = [], [], [], []
                for s in cutlass.range_constexpr(s0, min(self.world, s0 + COPY_BATCH)):
                    rows_s = m - Int32(s) * slice_rows  # shard s's rows
                    if rows_s > slice_rows:
                        rows_s = slice_rows
                    ok = (Int32(s) != rank) & (i < rows_s)
                    row = Int64(s) * Int64(slice_rows) + Int64(i)
                    mine = row - Int64(rank) * Int64(slice_rows)  # the row in my views
                    read = row * Int64(Int32(ok))  # row 0 when skipped: a valid address
                    for kd in cutlass.range_constexpr(len(kinds)):
                        area, rb, base, nbytes = kinds[kd]
                        oks.append(ok)
                        global_rows.append(Int32(s) * slice_rows + i)
                        dsts.append((base + mine * rb, nbytes))
                        loaded.append(self._unit_loads(own + area + read * rb, lane, nbytes))
                for c in cutlass.range_constexpr(len(oks)):
                    unit, units, per_lane = self._units(dsts[c][1])
                    for k in cutlass.range_constexpr(per_lane):
                        u = lane + Int32(k * self.t.threads_per_row)
                        if oks[c] & (u < Int32(units)):
                            if const_expr(c % len(kinds) == 1 and self.gather_swizzled):
                                self._swizzled_unit_store(s_base, global_rows[c], u, unit,
                                                          loaded[c][k])
                            else:
                                _unit_store(dsts[c][0] + Int64(u) * Int64(unit), loaded[c][k])
