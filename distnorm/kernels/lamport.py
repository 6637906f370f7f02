"""The Lamport one-shot all-reduce ("lamport"): its body ``LamportOneShot._lamport``, a part of the
kernel class ``AllReduceAddRMSNormQuant`` (kernels/allreduce.py, whose helpers it uses), and the
sentinel rewrite. Where its three rotating areas, call state and descriptor headers live is
``distnorm.collectives.layout``; filling them on the host is ``distnorm.collectives.state``.

NOTE [lamport sentinel]
Every 32-bit word of an unwritten area holds 0xFFFFFFFF (layout.LAMPORT_SENTINEL), i.e. two 16-bit
0xFFFF values, a NaN in both bf16 and fp16. Before sending, a writer rewrites every 16-bit element
equal to 0xFFFF to 0x7FFF (also a NaN), so a written word never equals the sentinel and a reader
knows a word has arrived when it differs from it (32-bit accesses are single-copy atomic, so a word is
never seen half-written; 128-bit stores may land in 32-bit pieces, which is why every word is
checked). Why a NaN and not -0.0 (0x8000 per element, as CUTLASS's example uses): rewriting -0.0 to
+0.0 changes results (when every rank sends -0.0, the exact sum acc = -0.0 becomes +0.0, and h, y and
the quantized zero codes change sign), whereas any sum containing a NaN is the canonical NaN on the
GPU (float32 add returns 0x7FFFFFFF whatever the payloads), so rewriting one NaN payload into another
cannot change any output for world >= 2. With world 1 (no add) a 0xFFFF input becomes 0x7FFF, i.e.
the NaN's sign bit is dropped; nothing else changes.

NOTE [lamport polls]
A reader polls its rows' vectors in its own area until every word of every peer slot differs from
the sentinel. Form "poll-all" (plan.LAMPORT_FORMS, a Tuning knob) re-reads every slot, x included,
on every pass, so at N ranks a spinning CTA loads N times the vectors it waits for, load traffic
the arriving peer stores share the memory system with. Form "poll-unseen" keeps, per slot, a mask
of the vectors not yet read complete and each pass reads only those: a vector whose four words all
arrived in one read is final for this call (the area is refilled only two calls later, NOTE
[lamport clearing]), and my own slot (x) is read once. The words summed are the same either way.

NOTE [descriptor check]
Each launch pushes its call descriptor (NOTE [call descriptor]) into header k of every peer; a
reader compares its peers' descriptors with its own and records a mismatch in the call that has
it. Both are thread 0 of the launch's last CTA, which takes no row when the grid has more than
one CTA (grid = min(groups, cap - 1) + 1; the rows go to the others): it pushes the descriptor,
does its share of the sentinel refill and waits for the peers' descriptors (with the same timeout,
peer -1 in the error), off every row's path, and the row CTAs' code has no descriptor work at all.
With a one-CTA grid (Tuning.max_ctas 1) that CTA's thread 0 does both: the push first, the wait
after its rows. A mismatch still arrives in the failing call: the launch ends only after its
checker saw every descriptor.
History: waiting for the descriptors inside the row poll cost lamport +4.5..+9% at M = 1 on
2 x H200 (benchmarks/results/lamport_descriptor_ab_h200_x2.md); looking at them from a row
thread's poll while a spare CTA took the rest when the grid had room (the form before this one)
still cost 1-5% at 1-2048 rows against no descriptor check
(benchmarks/results/faults_cost_h200_x2.md, table 3).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.collectives.layout import (CALL_W_LAMPORT_HDR, DESCRIPTOR_WORDS, DEVICE_ERROR_WORD,
                                         LAMPORT_SENTINEL_I32, LAMPORT_W_AREA, LAMPORT_W_ARRIVE,
                                         LAMPORT_W_VECS, MAX_WORLD, REGION_LAMPORT, region_word)
from distnorm.formats import VEC
from distnorm.kernels.norm_quant import half_name
from distnorm.kernels.sync import (SPIN_CHECK_MASK, atom_add_acq_rel_gpu_u32, gave_up,
                                   globaltimer_ns, ld_volatile_sys_u32, ld_volatile_sys_v4_u32,
                                   must_stop, record_mismatch, st_volatile_sys_v4_u32,
                                   st_volatile_u32)

__all__ = ["sanitize_word", "LamportOneShot"]


def sanitize_word(w):
    """Rewrite each 16-bit half equal to 0xFFFF into 0x7FFF (NOTE [lamport sentinel]); the result is
    never 0xFFFFFFFF. Branch-free Int32 arithmetic (device code)."""
    lo = Int32((w & 0xFFFF) == 0xFFFF)
    hi = Int32((w >> 16) == Int32(-1))  # arithmetic shift: -1 iff the high half is 0xFFFF
    return w ^ (lo << 15) ^ (hi << 31)


class LamportOneShot:
    """The lamport algorithm of AllReduceAddRMSNormQuant (which provides self.t, self.core,
    self.world, self.desc, _indices, _fragments, _row_addr, _finish_row, _describe_launch,
    _may_push)."""

    @cute.jit
    def _load_headers(self, rHdr, own_pad: Int64, rank: Int32, hdr_area: Int64):
        """Load the peers' descriptors in my header area into rHdr (peer s: words
        s * DESCRIPTOR_WORDS ...), for _headers_pending (NOTE [descriptor check])."""
        for s in cutlass.range_constexpr(self.world):
            if Int32(s) != rank:
                w = ld_volatile_sys_v4_u32(own_pad + hdr_area + Int64(s * 16))
                for i in cutlass.range_constexpr(DESCRIPTOR_WORDS):
                    rHdr[s * DESCRIPTOR_WORDS + i] = w[i]

    @cute.jit
    def _headers_pending(self, rHdr, rank: Int32, m: Int32, err_addr: Int64,
                         dev_err_addr: Int64) -> Int32:
        """The peers' descriptors _load_headers read: 1 while one has not arrived; a descriptor
        that differs from mine records a mismatch (naming its first differing word) and counts as
        arrived, so the caller stops waiting (the device error word stops the rest)."""
        pending = Int32(0)
        sent = Int32(LAMPORT_SENTINEL_I32)
        mine = (m, Int32(self.desc[1]), Int32(self.desc[2]), Int32(self.desc[3]))
        for s in cutlass.range_constexpr(self.world):
            if Int32(s) != rank:
                w = [rHdr[s * DESCRIPTOR_WORDS + i] for i in range(DESCRIPTOR_WORDS)]
                if (w[0] == sent) | (w[1] == sent) | (w[2] == sent) | (w[3] == sent):
                    pending = Int32(1)
                else:
                    bad = Int32(-1)
                    for j in cutlass.range_constexpr(DESCRIPTOR_WORDS):
                        i = DESCRIPTOR_WORDS - 1 - j  # last to first: `bad` ends at the first
                        if w[i] != mine[i]:
                            bad = Int32(i)
                    if bad >= Int32(0):
                        value = w[0]
                        for i in cutlass.range_constexpr(1, DESCRIPTOR_WORDS):
                            if bad == Int32(i):
                                value = w[i]
                        record_mismatch(err_addr, dev_err_addr, Int32(s), bad, value)
        return pending

    @cute.jit
    def _finish_headers(self, checker, hdr_left: Int32, own_pad: Int64, rank: Int32, m: Int32,
                        hdr_area: Int64, err_addr: Int64, dev_err_addr: Int64, k: Int32,
                        timeout: Int64):
        """NOTE [descriptor check], after the outputs: the checker thread waits for descriptors it
        did not see while polling rows (a timeout names peer -1), then refills its header area
        with the sentinel (area k's headers are next written in call c + 3, after this kernel)."""
        if checker:
            rHdr = cute.make_rmem_tensor(cute.make_layout(self.world * DESCRIPTOR_WORDS), Int32)
            spins = Int32(0)
            t0 = globaltimer_ns()
            while hdr_left != Int32(0):
                self._load_headers(rHdr, own_pad, rank, hdr_area)
                hdr_left = self._headers_pending(rHdr, rank, m, err_addr, dev_err_addr)
                if hdr_left != Int32(0):
                    spins = spins + Int32(1)
                    if gave_up(spins, t0, timeout, err_addr, dev_err_addr, Int32(-1), k) != Int32(0):
                        hdr_left = Int32(0)
            sent = Int32(LAMPORT_SENTINEL_I32)
            for s in cutlass.range_constexpr(self.world):
                if Int32(s) != rank:
                    st_volatile_sys_v4_u32(own_pad + hdr_area + Int64(s * 16), sent, sent, sent,
                                           sent)

    # NOTE [lamport call state]
    # Area index k (0, 1, 2) of a call, the rows each area last held, and an arrival counter live in
    # this rank's signal pad (layout.REGION_LAMPORT), never in kernel arguments, so CUDA-graph replays and
    # back-to-back launches continue from the stored state. The grid changes with M, so a per-CTA
    # counter would drift between CTA indices; instead every thread reads k at its start, and after
    # its pushes (bar.sync: all threads of the CTA have read k) thread 0 arrives on the counter
    # (atom.acq_rel.gpu); the LAST CTA to arrive -- after every CTA of this launch has read k --
    # resets the counter, records this call's vectors per slot for area k and advances k. The rows
    # word of the previous area, read later, is not written by this launch. The next launch on the
    # stream reads the state after this one ended.
    # Every rank runs the same sequence of lamport calls (same M), so k agrees across ranks.
    #
    # NOTE [lamport clearing]
    # Call c uses area k = c mod 3: every rank pushes its rows into area k of every rank, reads its
    # own area k until no word is the sentinel, and meanwhile refills with the sentinel its own area
    # (k + 2) mod 3 = the area of call c - 1, over the N * M_{c-1} * H_{c-1} elements call c - 1
    # wrote (the state records M * H / 8 vectors per slot, not rows: H may change between calls).
    # (1) Nothing writes that area any more: every word of it that call c - 1 wrote was seen non-
    #     sentinel by this rank's kernel c - 1 (each valid row is polled over all N slots and all
    #     vectors by exactly one CTA), so all those stores had landed before kernel c began.
    # (2) It is completely refilled before any peer writes it again: the next writes into it are
    #     call c + 2's. A peer in call c + 2 has finished call c + 1, which needed our call-(c + 1)
    #     rows, which we push only in kernel c + 1, i.e. after kernel c (and its refill) ended.
    # (3) Likewise area k itself (call c - 3's area, refilled during call c - 2) is all sentinel
    #     before any call-c write lands in it: a peer writing call-c rows has finished call c - 1,
    #     which needed our call-(c - 1) rows, pushed in kernel c - 1, after kernel c - 2 ended.
    # So a peer is at most one call ahead of us (it cannot finish call c + 1 before reading our
    # call-(c + 1) rows): while we run call c, peers write only areas c and c + 1 of ours, never
    # c + 2 = c - 1, the one being refilled. Requirements: kernels of one rank run in stream order
    # (one stream per workspace; with programmatic dependent launch the kernel waits for its
    # predecessor before its first memory access, NOTE [programmatic dependent launch]) and a call
    # never writes more than one area (max_chunk_rows("lamport")). oneshot / twoshot do not touch the lamport areas.
    @staticmethod
    def _or_sentinels(pending, a, b, c, d):
        """`pending`, or 1 where one of the four words still holds the sentinel (NOTE [lamport
        sentinel]: a word of -1 is not yet written)."""
        pending = pending | Int32(a == Int32(-1)) | Int32(b == Int32(-1))
        return pending | Int32(c == Int32(-1)) | Int32(d == Int32(-1))

    @cute.jit
    def _load_vector(self, rAll, s: cutlass.Constexpr, j: cutlass.Constexpr, src: Int64, v):
        """Vector v of the slot at `src` (volatile, system scope) into words (s * nv + j) * 4 ...
        of rAll; returns the four words."""
        a, b, c, d = ld_volatile_sys_v4_u32(src + Int64(v) * Int64(16))
        w0 = (s * self.t.vecs_per_thread + j) * 4
        rAll[w0] = a
        rAll[w0 + 1] = b
        rAll[w0 + 2] = c
        rAll[w0 + 3] = d
        return a, b, c, d

    @cute.jit
    def _poll_unseen(self, rAll, rWait, s: cutlass.Constexpr, src: Int64, own: Int64, rank: Int32,
                     lane: Int32, pending: Int32) -> Int32:
        """One pass of NOTE [lamport polls] over slot s: read the vectors of rWait[s] (slot
        `rank` from `own`, x, complete at once), clear the bits of those that arrived whole;
        `pending` becomes 1 while any is left."""
        own_slot = Int32(s) == rank
        if own_slot:
            src = own
        for j in cutlass.range_constexpr(self.t.vecs_per_thread):
            if ((rWait[s] >> j) & Int32(1)) != Int32(0):
                a, b, c, d = self._load_vector(rAll, s, j, src, lane + j * self.t.row_threads)
                if ((a != Int32(-1)) & (b != Int32(-1)) & (c != Int32(-1)) & (d != Int32(-1))) \
                        | own_slot:
                    rWait[s] = rWait[s] & Int32(~(1 << j))
        if rWait[s] != Int32(0):
            pending = Int32(1)
        return pending

    @cute.jit
    def _late_slot(self, rAll, rWait, rank: Int32, lane: Int32) -> Int32:
        """NOTE [lazy missing]: the last peer slot whose words, as the last poll pass left them
        in registers (rAll; rWait in form poll-unseen), still hold a sentinel: the peer a timeout
        names."""
        t = self.t
        late = Int32(0)
        for s in cutlass.range_constexpr(self.world):
            pend_s = Int32(0)
            if const_expr(self.poll_unseen):
                pend_s = Int32(rWait[s] != Int32(0))
            else:
                for j in cutlass.range_constexpr(t.vecs_per_thread):
                    if const_expr(t.exact) or lane + j * t.row_threads < t.vecs:
                        w0 = (s * t.vecs_per_thread + j) * 4
                        pend_s = self._or_sentinels(pend_s, rAll[w0], rAll[w0 + 1], rAll[w0 + 2],
                                                    rAll[w0 + 3])
            if (pend_s != Int32(0)) & (Int32(s) != rank):
                late = Int32(s)
        return late

    @cute.jit
    def _lamport(self, mX, mR, mRout, mW, mY, mQ, mS, mScale, mGS, mAR, mBuf, mSig, mErr,
                 rank: Int32, eps: Float32, timeout: Int64, rows: Int32, groups: Int32,
                 own_pad: Int64):
        t = self.t
        world = self.world
        dtype = mX.element_type
        tidx, bidx, nblk, row_in_cta, lane = self._indices()
        m = mX.shape[0]
        hidden = Int64(t.hidden)
        elem_bytes = Int64(dtype.width // 8)
        slot_bytes = Int64(m) * hidden * elem_bytes  # one slot: this call's M rows of T
        nv = t.vecs_per_thread

        bufs, _, rR, rH, static_scale, global_scale, rW = self._fragments(dtype, mW, mScale, mGS,
                                                                         lane)
        # N slots' words; fragments of rows are read and written as words only (NOTE in
        # NormQuantCore.widen: a fragment read through two views was miscompiled)
        rAll = cute.make_rmem_tensor(cute.make_layout(world * nv * 4), Int32)
        rAll.fill(0)
        rWait = cute.make_rmem_tensor(cute.make_layout(world), Int32)  # NOTE [lamport polls]
        rTw = self.core.zero_words()
        half = half_name(dtype)

        # the first row's load is issued before the state loads (their inline asm orders memory
        # accesses): at one row per CTA the two latencies overlap instead of adding up
        row0 = bidx * t.rows_per_cta + row_in_cta
        if row0 < m:
            self.core.load_row16(rTw, mX[row0, None], lane)

        # call state (NOTE [lamport call state])
        state = own_pad + Int64(region_word(REGION_LAMPORT) * 4)
        area_addr = state + Int64(LAMPORT_W_AREA * 4)
        arrive_addr = state + Int64(LAMPORT_W_ARRIVE * 4)
        rows_addr = state + Int64(LAMPORT_W_VECS * 4)
        k = ld_volatile_sys_u32(area_addr)
        kw = k * Int32(world)

        # NOTE [descriptor check]: the last CTA is the checker's, with no row when the grid has
        # more than one (row_ctas: the CTAs that take rows); its thread 0 pushes this launch's
        # descriptor into header k of every other rank and compares theirs with its own
        spare = Int32(nblk > 1)
        row_ctas = nblk - spare
        first_group = bidx
        if bidx >= row_ctas:
            first_group = groups  # the checker's CTA: no row group
        checker = (tidx == 0) & (bidx == nblk - 1)
        self._describe_launch(own_pad, m)
        # NOTE [a failed rank arrives nowhere]: a launch that finds the device error word set
        # pushes neither its descriptor nor its rows, so the peers time out instead of summing
        # Only CTAs with something to push load the word: every warp's load of the one word
        # queues at its L2 line; when padding rows were row groups (before NOTE [padding words])
        # the guard cost up to 0.5 us at one NVFP4 row on 2 x H200
        # (benchmarks/results/faults_cost_h200_x2.md, table 3)
        may_push = Int32(1)
        if (first_group * Int32(t.rows_per_cta) < m) | checker:
            may_push = self._may_push(own_pad)
        hdr_area = Int64(CALL_W_LAMPORT_HDR * 4) + Int64(k) * Int64(MAX_WORLD * DESCRIPTOR_WORDS * 4)
        if checker & (may_push != Int32(0)):
            for s in cutlass.range_constexpr(world):
                if Int32(s) != rank:
                    st_volatile_sys_v4_u32(mSig[s] + hdr_area + Int64(rank) * Int64(16), m,
                                           Int32(self.desc[1]), Int32(self.desc[2]),
                                           Int32(self.desc[3]))

        # phase 1: push my rows (sanitized, NOTE [lamport sentinel]) into area k, slot `rank`, of
        # every other rank with 128-bit volatile stores. My own slot is never written (it stays
        # sentinel): phase 2 takes my rows from x.
        for g in range(first_group, groups, row_ctas):
            row = g * t.rows_per_cta + row_in_cta
            if (row < m) & (may_push != Int32(0)):  # NOTE [push guard]
                if g != bidx:  # the first row is already loaded
                    self.core.load_row16(rTw, mX[row, None], lane)
                for i in cutlass.range_constexpr(nv * 4):
                    rTw[i] = sanitize_word(rTw[i])
                off = slot_bytes * Int64(rank) + Int64(row) * hidden * elem_bytes
                for s in cutlass.range_constexpr(world):
                    if Int32(s) != rank:
                        dst = mBuf[kw + Int32(s)] + off
                        for j in cutlass.range_constexpr(nv):
                            v = lane + j * t.row_threads
                            if const_expr(t.exact) or v < t.vecs:
                                st_volatile_sys_v4_u32(dst + Int64(v) * Int64(16), rTw[4 * j],
                                                       rTw[4 * j + 1], rTw[4 * j + 2],
                                                       rTw[4 * j + 3])

        if const_expr(self.q.swizzled):  # NOTE [padding words] in kernels/allreduce.py
            self.core.store_padding_words(mS, m, bidx * Int32(t.threads) + tidx,
                                          nblk * Int32(t.threads))
        # arrive after the pushes are issued, so the atomic is off their critical path
        cute.arch.barrier()  # every thread of this CTA has read k
        if tidx == 0:
            old = atom_add_acq_rel_gpu_u32(arrive_addr, Int32(1))
            if old == Int32(nblk) - Int32(1):  # the last CTA of this launch
                nxt = k + Int32(1)
                if nxt >= Int32(3):
                    nxt = Int32(0)
                st_volatile_u32(arrive_addr, Int32(0))
                st_volatile_u32(rows_addr + Int64(k) * Int64(4), m * Int32(t.hidden // VEC))
                st_volatile_u32(area_addr, nxt)

        # refill the peers' slots of my area of the previous call with the sentinel (NOTE [lamport
        # clearing]); 16-byte vectors, grid-stride over the whole launch. vecs_prev: the previous
        # call's vectors per slot (its M and H may differ from ours)
        prev = k + Int32(2)
        if prev >= Int32(3):
            prev = prev - Int32(3)
        vecs_prev = ld_volatile_sys_u32(rows_addr + Int64(prev) * Int64(4))
        clear_base = mBuf[prev * Int32(world) + rank]
        sent = Int32(LAMPORT_SENTINEL_I32)
        for s in cutlass.range_constexpr(world):
            if Int32(s) != rank:
                slot_base = clear_base + Int64(s) * Int64(vecs_prev) * Int64(16)
                for i in range(bidx * Int32(t.threads) + tidx, vecs_prev, nblk * Int32(t.threads)):
                    st_volatile_sys_v4_u32(slot_base + Int64(i) * Int64(16), sent, sent, sent, sent)

        # phase 2: poll my area k until every word of the other slots of my rows arrived, ordered
        # float32 sum (my slot read from x), residual add, epilogue
        base = mBuf[kw + rank]
        err_addr = mErr.iterator.toint()
        dev_err_addr = own_pad + Int64(DEVICE_ERROR_WORD * 4)
        hdr_left = Int32(checker)  # 1 while a peer's descriptor is unseen (_finish_headers)
        for g in range(first_group, groups, row_ctas):
            row = g * t.rows_per_cta + row_in_cta
            row_valid = row < m
            rH.fill(0.0)
            if row_valid:
                if const_expr(self.has_residual):  # issued before the polls: off the critical path
                    self.core.load_row(rR, cute.zipped_divide(mR[row, None], (VEC,)), lane)
                row_off = base + Int64(row) * hidden * elem_bytes
                own = self._row_addr(mX, row)
                if const_expr(self.poll_unseen):
                    # bit j of rWait[s]: vector j of slot s not read complete yet
                    for s in cutlass.range_constexpr(world):
                        wait_s = Int32(0)
                        for j in cutlass.range_constexpr(nv):
                            if const_expr(t.exact):
                                wait_s = wait_s | Int32(1 << j)
                            else:
                                wait_s = wait_s | (Int32(lane + j * t.row_threads < t.vecs) << j)
                        rWait[s] = wait_s
                pending = Int32(1)
                spins = Int32(0)
                t0 = globaltimer_ns()
                while pending != Int32(0):
                    pending = Int32(0)
                    for s in cutlass.range_constexpr(world):
                        src = row_off + slot_bytes * Int64(s)
                        if const_expr(self.poll_unseen):
                            pending = self._poll_unseen(rAll, rWait, s, src, own, rank, lane,
                                                        pending)
                        else:
                            peer = Int32(1)
                            if Int32(s) == rank:  # x itself: any bits, never waited for
                                src = own
                                peer = Int32(0)
                            pend_s = Int32(0)
                            for j in cutlass.range_constexpr(nv):
                                v = lane + j * t.row_threads
                                if const_expr(t.exact) or v < t.vecs:
                                    a, b, c, d = self._load_vector(rAll, s, j, src, v)
                                    pend_s = self._or_sentinels(pend_s, a, b, c, d)
                            pending = pending | (pend_s & peer)
                    if pending != Int32(0):
                        spins = spins + Int32(1)
                        # NOTE [lazy missing]: which peer is late is worked out from the words
                        # of the last pass only here, every SPIN_CHECK_MASK + 1 passes, not in
                        # every pass (the poll loop's checks cost up to 0.13 us per call at 1-128
                        # rows on 2 x H200, faults_lamport_parts2_ab_h200_x2.md)
                        if (spins & Int32(SPIN_CHECK_MASK)) == Int32(0):
                            missing = self._late_slot(rAll, rWait, rank, lane)
                            if must_stop(t0, timeout, err_addr, dev_err_addr, missing, k) \
                                    != Int32(0):
                                pending = Int32(0)
                # float32 sum over the slots in rank order (the other algorithms' order)
                for s in cutlass.range_constexpr(world):
                    for i in cutlass.range_constexpr(nv * 4):
                        lo, hi = self.core.word_values(rAll[s * nv * 4 + i], half)
                        if const_expr(s > 0):
                            lo, hi = rH[2 * i] + lo, rH[2 * i + 1] + hi
                        rH[2 * i], rH[2 * i + 1] = lo, hi
                self._finish_row(rH, rR, mAR, mRout, row, lane, dtype)
            self.core.epilogue(rH, row, row_valid, row < rows, lane, row_in_cta, eps, mW,
                               mY, mQ, mS, static_scale, global_scale, bufs, rW)
            cute.arch.barrier()  # the next group's reductions reuse the shared-memory partials
        self._finish_headers(checker, hdr_left, own_pad, rank, m, hdr_area, err_addr, dev_err_addr, k,
                             timeout)
        # no closing barrier: the three rotating areas make the next call safe (NOTE above)
