"""The reduce-scatter form "roles-tma": pusher CTAs that push x through the TMA and finisher CTAs
that finish row groups as they land, meeting through flags and counts in the signal pads instead
of same-index barriers. A part of the kernel class AllReduceAddRMSNormQuant, like ReduceScatter
(kernels/reducescatter.py calls _roles_reducescatter); the PTX is kernels/bulk.py's and sync.py's.

NOTE [reduce-scatter roles by TMA] (issue 13, docs/SEQPAR_HISTORY.md "The next lever"): the
pipelined forms' barriers pair same-index CTAs, so every CTA must both push and finish, and
thread-store pushes hold the threads that should finish rows. Here CTAs 0 .. P - 1 of the grid
push (P = min(ROLES_PUSHERS, grid - 1): the grid is in the call's signature, so the same CTAs on
every rank) and the other F = grid - P finish. Row groups are cut into C chunks of k consecutive
groups (k = 1 unless the pad's flag words would not hold them; equal on every rank: from the
shard's groups and the world size); pusher p takes chunks p, p + P, ... in order and, per group
and peer t, bulk loads x's rows s * S + g * rows_per_cta onward (shard t) into one of two
shared-memory stages (counted on the stage's mbarrier) and bulk stores them into slot `rank` of
t's buffer (a bulk group each). After a chunk's last group it waits for its writes
(cp.async.bulk.wait_group 0), fences the async proxy against the generic one (fence.proxy.async,
so that the generic release below covers the async writes, as in NOTE [bulk-copy pushes]) and
sets flag (chunk, rank) in every peer's pad to (epoch, signature) with st.release.sys. Finisher f
takes groups f, f + F, ...: threads t < world poll flag (chunk of g, t) in my pad with
ld.acquire.sys (the deadline and device error word of every other wait; a flag with another
signature is a mismatch: the descriptor check), a bar.red ORs their failures, and the CTA runs
_shard_group (the same float32 sum in rank order, epilogue and q pushes as every other form: the
same bits). After its last group (its last read of its slots and its last q stores, ordered by
_shard_group's CTA barrier and the release's cumulativity) thread t adds 1 to count `rank` in
peer t's pad with red.release.sys. Pusher CTA 0 then waits until my pad's count of every peer
reaches expect + F (its finishers have read everything I pushed in this call), so the kernel ends
only when no peer reads my pushes any more: the next call, of any algorithm, may push again
(a wait at the start of the next roles-tma call instead would not keep another algorithm's pushes
off: tests/test_buffer_protocol.py). With the gather, every finisher waits for the same counts
before its copy-out (the peers pushed their q rows before counting), which also makes the
pushers' wait redundant there; it is kept (one CTA's poll).

Epochs: EPOCH (this rank's last call's epoch) and EXPECT (the counts wanted after it) in my pad;
every CTA's threads t < world read them, a CTA barrier, then thread 0 counts the CTA in ARRIVE
(atom.acq_rel.gpu: its release covers the reads, by the CTA barrier's cumulativity); the last CTA
(old = grid - 1) stores ARRIVE = 0, EPOCH + 1 and EXPECT + F, which only the next launch reads
(stream order). Every rank runs the same roles-tma calls with the same grids, so epochs and
expected counts agree; flags and counts are never cleared (signed 32-bit differences, which
survive wrap-around: no flag or count can be 2^31 behind). A failed rank (device error word set)
pushes nothing and sets no flag or count (NOTE [a failed rank arrives nowhere]): its peers time
out; after a CommError the host zeroes this region with the barrier regions.

Shared memory: two stages of one (group, peer) part each within bulkpush's budget (every CTA of
the grid carries them, and finishers spin on flags that pushers set, so the whole grid must be
resident: the grid cap's co_resident_ctas_per_sm with BULK_SM_BYTES per SM, as pipelined-tma);
where a part does not fit, the form is "serial" (a compile-time choice from H, rows_per_cta and
the tiling: equal on every rank). A rank whose x is strided pushes with its pusher CTAs' thread
stores in the same chunks, flags after a CTA barrier: the protocol is the same.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.collectives.layout import (DEVICE_ERROR_WORD, ROLES_W_ARRIVE, ROLES_W_DONE,
                                         ROLES_W_EPOCH, ROLES_W_EXPECT, ROLES_W_FLAGS,
                                         ROLES_FLAG_WORDS, MAX_WORLD, region_word,
                                         REGION_ROLES)
from distnorm.kernels.bulk import (bulk_commit_empty, bulk_copy_g2s, bulk_store_s2g,
                                   bulk_wait_all, bulk_wait_all_but_newest,
                                   bulk_wait_read_all_but_newest, fence_proxy_async,
                                   mbar_arrive_expect_tx, mbar_init)
from distnorm.kernels.bulkpush import _SMEM_RESERVED, bulk_smem_bytes
from distnorm.kernels.ptx import mbarrier_try_wait, smem_ptr_u32
from distnorm.kernels.sync import (atom_add_acq_rel_gpu_u32, barrier_or, gave_up,
                                   ld_acquire_sys_u32, ld_acquire_sys_u32x2, ld_relaxed_sys_u32,
                                   ld_volatile_sys_u32,
                                   record_mismatch, red_add_release_sys_u32, st_relaxed_sys_u32,
                                   st_release_sys_u32x2, globaltimer_ns)

__all__ = ["ROLES_FORM", "ROLES_PUSHERS", "RolesPushes", "roles_fit"]

ROLES_FORM = "roles-tma"
# pusher CTAs: 8 carry the link with 32 KiB bulk copies (benchmarks/results/push_h200_x2.md)
ROLES_PUSHERS = 8


def roles_fit(hidden: int, rows_per_cta: int, ctas_per_sm: int, elem_bytes: int = 2) -> bool:
    """Whether roles-tma's two stages of one (group, peer) part fit its shared memory and a row is
    whole 16-byte units; else the form runs as "serial"."""
    part = rows_per_cta * hidden * elem_bytes
    return (hidden * elem_bytes) % 16 == 0 and \
        2 * part <= bulk_smem_bytes(ctas_per_sm) - _SMEM_RESERVED


class RolesPushes:
    """The roles-tma body of AllReduceAddRMSNormQuant (self.t, self.world, self.gather_q,
    _push_slices, _shard_group, _copy_out_q come from it and ReduceScatter; _bulk_rows from
    BulkPushes)."""

    @cute.jit
    def _roles_wait(self, addr: Int64, target: Int32, wide: cutlass.Constexpr, sig: Int32,
                    peer: Int32, timeout: Int64, err_addr: Int64, dev_err: Int64) -> Int32:
        """Poll the word (wide: the 64-bit flag (epoch, signature)) at addr with ld.acquire.sys
        until it reaches target (signed difference); 1 when it gave up (deadline, or another
        wait failed: the device error word) or, wide, the flag came with another signature."""
        v = Int32(0)
        peer_sig = sig
        if const_expr(wide):
            v, peer_sig = ld_acquire_sys_u32x2(addr)
        else:
            v = ld_acquire_sys_u32(addr)
        waiting = Int32((v - target) < Int32(0))
        failed = Int32(0)
        spins = Int32(0)
        t0 = globaltimer_ns()
        while waiting != Int32(0):
            if const_expr(wide):
                v, peer_sig = ld_acquire_sys_u32x2(addr)
            else:
                v = ld_acquire_sys_u32(addr)
            if (v - target) >= Int32(0):
                waiting = Int32(0)
            spins = spins + Int32(1)
            if waiting != Int32(0):
                if gave_up(spins, t0, timeout, err_addr, dev_err, peer, target) != Int32(0):
                    waiting = Int32(0)
                    failed = Int32(1)
        if const_expr(wide):
            if (failed == Int32(0)) & (peer_sig != sig):
                record_mismatch(err_addr, dev_err, peer, Int32(-1), peer_sig)
                failed = Int32(1)
        return failed

    @cute.jit
    def _roles_reducescatter(self, mX, mBuf, mSig, mErr, rank: Int32, timeout: Int64,
                             slice_rows: Int32, groups: Int32, sig: Int32, may_push: Int32,
                             smem, sg_args, q_base: Int64, s_base: Int64, rT, dtype,
                             row_in_cta: Int32, lane: Int32):
        """NOTE [reduce-scatter roles by TMA]. sg_args: _shard_group's arguments after g."""
        tidx, bidx, nblk = cute.arch.thread_idx()[0], cute.arch.block_idx()[0], \
            cute.arch.grid_dim()[0]
        row_bytes = self.t.hidden * (dtype.width // 8)
        part = self.t.rows_per_cta * row_bytes
        stages = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(2 * part),
                                      byte_alignment=128)
        mbars = smem.allocate_tensor(Int64, cute.make_layout(2), byte_alignment=8)
        pushers = Int32(self.roles_pushers)
        if pushers > nblk - Int32(1):
            pushers = nblk - Int32(1)
        fin = nblk - pushers
        # chunks of k groups, so that every (chunk, rank) flag has its two words: ceil(groups / k)
        # chunks take at most (groups / k + 1) * 2 * world words
        cap = ROLES_FLAG_WORDS - 2 * MAX_WORLD
        k = (groups * Int32(2 * self.world) + Int32(cap - 1)) // Int32(cap)
        if k < Int32(1):
            k = Int32(1)
        chunks = (groups + k - Int32(1)) // k
        own = mSig[rank]
        region = own + Int64(region_word(REGION_ROLES) * 4)
        dev_err = own + Int64(DEVICE_ERROR_WORD * 4)
        err_addr = mErr.iterator.toint()
        # the call's epoch and wanted counts, read by every CTA before it counts itself in
        epoch = Int32(0)
        expect = Int32(0)
        if tidx < Int32(self.world):
            epoch = ld_relaxed_sys_u32(region + Int64(ROLES_W_EPOCH * 4)) + Int32(1)
            expect = ld_relaxed_sys_u32(region + Int64(ROLES_W_EXPECT * 4)) + fin
        cute.arch.barrier()
        if tidx == Int32(0):
            old = atom_add_acq_rel_gpu_u32(region + Int64(ROLES_W_ARRIVE * 4), Int32(1))
            if old == nblk - Int32(1):  # the last CTA: the next launch's epoch and counts
                st_relaxed_sys_u32(region + Int64(ROLES_W_ARRIVE * 4), Int32(0))
                st_relaxed_sys_u32(region + Int64(ROLES_W_EPOCH * 4), epoch)
                st_relaxed_sys_u32(region + Int64(ROLES_W_EXPECT * 4), expect)
        flags = Int64(region_word(REGION_ROLES) + ROLES_W_FLAGS) * Int64(4)
        if bidx < pushers:
            self._roles_push(mX, mBuf, mSig, rank, slice_rows, groups, k, chunks, bidx, pushers,
                             epoch, sig, may_push, flags, smem_ptr_u32(stages.iterator),
                             smem_ptr_u32(mbars.iterator), part, row_bytes, tidx, row_in_cta,
                             lane, rT, dtype)
            if bidx == Int32(0):
                # the kernel ends when every peer's finishers have read all I pushed
                failed = Int32(0)
                if (tidx < Int32(self.world)) & (tidx != rank):
                    failed = self._roles_wait(region + Int64((ROLES_W_DONE + tidx) * 4), expect,
                                              False, sig, tidx, timeout, err_addr, dev_err)
                barrier_or(failed)
        else:
            f = bidx - pushers
            # NOTE [a failed rank arrives nowhere]: a launch that finds the error word set, or a
            # group that finds it set since (another CTA's wait failed), writes no more q rows to
            # the peers and counts nothing
            failed = barrier_or(Int32(may_push == Int32(0)))
            for g in range(f, groups, fin):
                if failed == Int32(0):
                    bad = Int32(0)
                    if (tidx < Int32(self.world)) & (tidx != rank):
                        if ld_volatile_sys_u32(dev_err) != Int32(0):
                            bad = Int32(1)
                        else:
                            word = flags + Int64(((g // k) * Int32(self.world) + tidx)
                                                 * Int32(8))
                            bad = self._roles_wait(own + word, epoch, True, sig, tidx, timeout,
                                                   err_addr, dev_err)
                    failed = barrier_or(bad)
                    if failed == Int32(0):
                        self._shard_group(g, *sg_args)
            # my last reads of my slots and my q stores before the count (the release covers
            # what the CTA barrier ordered before it)
            cute.arch.barrier()
            if failed == Int32(0):
                if (tidx < Int32(self.world)) & (tidx != rank):
                    red_add_release_sys_u32(mSig[tidx] + Int64((region_word(REGION_ROLES)
                                                                + ROLES_W_DONE) * 4)
                                            + Int64(rank) * Int64(4), Int32(1))
            if const_expr(self.gather_q):
                bad = Int32(0)
                if (failed == Int32(0)) & (tidx < Int32(self.world)) & (tidx != rank):
                    bad = self._roles_wait(region + Int64((ROLES_W_DONE + tidx) * 4), expect,
                                           False, sig, tidx, timeout, err_addr, dev_err)
                failed = barrier_or(bad | failed)
                self._copy_out_q(mBuf, q_base, s_base, mX.shape[0], slice_rows, rank,
                                 self._unless_failed(failed, groups), f, fin, row_in_cta, lane)

    @cute.jit
    def _roles_push(self, mX, mBuf, mSig, rank: Int32, slice_rows: Int32, groups: Int32,
                    k: Int32, chunks: Int32, p: Int32, pushers: Int32, epoch: Int32, sig: Int32,
                    may_push: Int32, flags: Int64, stages: Int32, mbars: Int32,
                    part: cutlass.Constexpr, row_bytes: cutlass.Constexpr, tidx: Int32,
                    row_in_cta: Int32, lane: Int32, rT, dtype: cutlass.Constexpr):
        """Pusher p: chunks p, p + P, ... in order; per chunk its groups' parts (group, peer), then
        the chunk's flags in every peer's pad (NOTE [reduce-scatter roles by TMA])."""
        x_bulk = Int64(mX.stride[0]) == Int64(self.t.hidden)
        if x_bulk:
            if tidx == Int32(0):
                mbar_init(mbars)
                mbar_init(mbars + Int32(8))
                # part j = (chunk c, group g, peer index e: peer e, or e + 1 from my rank on), in
                # stage j % 2; part j + 1's load is issued while part j's store drains, and a
                # chunk's flags wait for its stores while the next part's store is in flight
                c = p
                g = p * k
                e = Int32(0)
                j = Int32(0)
                pending = Int32(-1)  # a chunk whose stores are issued, its flags not yet set
                if c < chunks:
                    self._roles_load(mX, stages, mbars, j, g, e, rank, slice_rows, part,
                                     row_bytes)
                while c < chunks:
                    # the next part
                    nc, ng, ne = c, g, e + Int32(1)
                    if ne == Int32(self.world - 1):
                        ne = Int32(0)
                        ng = g + Int32(1)
                        if (ng == (c + Int32(1)) * k) | (ng == groups):
                            nc = c + pushers
                            ng = nc * k
                    ready = Int32(0)
                    while ready == Int32(0):
                        ready = mbarrier_try_wait(mbars + (j & Int32(1)) * Int32(8),
                                                  (j >> Int32(1)) & Int32(1))
                    # the landed stage, and the previous kernel's reads of the peers' slots (its
                    # end wait's acquire), before the async proxy's reads and remote writes
                    fence_proxy_async()
                    s = e + Int32(e >= rank)
                    n = self._bulk_rows(g, s, slice_rows, mX.shape[0])
                    if (n > Int32(0)) & (may_push != Int32(0)):
                        dst = mBuf[s] + Int64(slice_rows) * Int64(rank) * Int64(row_bytes) \
                            + Int64(g * Int32(self.t.rows_per_cta)) * Int64(row_bytes)
                        bulk_store_s2g(dst, stages + (j & Int32(1)) * Int32(part),
                                       n * Int32(row_bytes))
                    else:
                        bulk_commit_empty()  # one bulk group per part, stored or not
                    if pending >= Int32(0):
                        # every store but part j's performed, then visible to the generic release
                        bulk_wait_all_but_newest()
                        fence_proxy_async()
                        if may_push != Int32(0):
                            self._roles_flags(mSig, rank, pending, epoch, sig, flags)
                        pending = Int32(-1)
                    if nc < chunks:  # stage (j + 1) % 2 held part j - 1, whose store has read it
                        bulk_wait_read_all_but_newest()
                        self._roles_load(mX, stages, mbars, j + Int32(1), ng, ne, rank,
                                         slice_rows, part, row_bytes)
                    if nc != c:
                        pending = c
                    c, g, e = nc, ng, ne
                    j = j + Int32(1)
                if pending >= Int32(0):
                    bulk_wait_all()
                    fence_proxy_async()
                    if may_push != Int32(0):
                        self._roles_flags(mSig, rank, pending, epoch, sig, flags)
        else:
            # strided x: every thread stores (two-shot's push), the flags after a CTA barrier
            for c in range(p, chunks, pushers):
                g1 = (c + Int32(1)) * k
                if g1 > groups:
                    g1 = groups
                self._push_slices(mX, mBuf, rank, slice_rows, g1, c * k, Int32(1), row_in_cta,
                                  lane, rT, dtype, may_push)
                cute.arch.barrier()
                if (tidx == Int32(0)) & (may_push != Int32(0)):
                    self._roles_flags(mSig, rank, c, epoch, sig, flags)

    @cute.jit
    def _roles_load(self, mX, stages: Int32, mbars: Int32, j: Int32, g: Int32, e: Int32,
                    rank: Int32, slice_rows: Int32, part: cutlass.Constexpr,
                    row_bytes: cutlass.Constexpr):
        """Part j's rows of x (group g of the shard of peer index e) into stage j % 2, counted on
        its mbarrier (one arrival expecting them; 0 bytes: the phase completes at once)."""
        s = e + Int32(e >= rank)
        n = self._bulk_rows(g, s, slice_rows, mX.shape[0])
        mbar = mbars + (j & Int32(1)) * Int32(8)
        mbar_arrive_expect_tx(mbar, n * Int32(row_bytes))
        if n > Int32(0):
            first = s * slice_rows + g * Int32(self.t.rows_per_cta)
            bulk_copy_g2s(stages + (j & Int32(1)) * Int32(part),
                          mX.iterator.toint() + Int64(first) * Int64(row_bytes),
                          n * Int32(row_bytes), mbar)

    @cute.jit
    def _roles_flags(self, mSig, rank: Int32, c: Int32, epoch: Int32, sig: Int32, flags: Int64):
        """Flag (chunk c, rank) := (epoch, signature) in every peer's pad, st.release.sys."""
        for s in cutlass.range_constexpr(self.world):
            if Int32(s) != rank:
                st_release_sys_u32x2(mSig[s] + flags + Int64((c * Int32(self.world) + rank)
                                                             * Int32(8)), epoch, sig)
