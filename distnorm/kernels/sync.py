"""Memory-ordering PTX primitives and the cross-rank CTA barrier used by the all-reduce kernels.

Primitives (inline PTX through ``llvm.inline_asm``, same interface in CuTe DSL 4.3.5 and 4.8; every
one is a device function taking 64-bit generic/global addresses as ``Int64``):

    ld_acquire_sys_u32(addr) -> Int32          ld.acquire.sys.global.u32
    ld_relaxed_sys_u32(addr) -> Int32          ld.relaxed.sys.global.u32
    ld_volatile_sys_u32(addr) -> Int32         ld.volatile.global.u32 (also sees host-pinned memory)
    st_release_sys_u32(addr, v)                st.release.sys.global.u32
    st_relaxed_sys_u32(addr, v)                st.relaxed.sys.global.u32
    st_volatile_u32(addr, v)                   st.volatile.global.u32
    ld_weak_u32(addr) -> Int32                 ld.global.u32 (weak)
    ld_weak_v4_u32(addr) -> 4 x Int32          ld.global.v4.u32 (weak)
    st_weak_v4_u32(addr, a, b, c, d)           st.global.v4.u32 (weak)
    st_weak_u32(addr, v)                       st.global.u32 (weak)
    atomic_cas_sys_u32(addr, cmp, v) -> Int32  atom.relaxed.sys.global.cas.b32 (returns the old value)
    atomic_add_gpu_u32(addr, v)                red.relaxed.gpu.global.add.u32
    atom_add_acq_rel_gpu_u32(addr, v) -> Int32 atom.acq_rel.gpu.global.add.u32 (returns the old value)
    red_add_release_sys_u32(addr, v)           red.release.sys.global.add.u32
    barrier_or(pred) -> Int32                  bar.red.or.pred: a CTA barrier returning any thread's pred
    fence_acq_rel_sys()                        fence.acq_rel.sys
    globaltimer_ns() -> Int64                  mov.u64 %globaltimer (ns; ~1 us granularity)
    ld_volatile_sys_v4_u32(addr) -> 4 x Int32  ld.volatile.global.v4.u32 (16-byte aligned)
    st_volatile_sys_v4_u32(addr, a, b, c, d)   st.volatile.global.v4.u32 (16-byte aligned)
    ld_acquire_sys_u32x2(addr) -> 2 x Int32    ld.acquire.sys.global.u64 split into (lo, hi)
    st_release_sys_u32x2(addr, lo, hi)         st.release.sys.global.u64 of (lo, hi)

Ordered ones carry a ``memory`` clobber so LLVM never moves plain loads/stores across them.

Cross-rank CTA barrier: ``cta_barrier(signal_ptrs, rank, world, region_word, block, timeout, err)``
(see its docstring) over one signal-pad region of ``distnorm.collectives.layout`` (epochs then
flags; each algorithm owns its region). The host side (region checks and resets, the timeout
setting) lives in ``distnorm.collectives``; this module is device code only.

Kernel modules import this one absolutely (``from distnorm.kernels import sync``): the 4.3.5 DSL
preprocessor cannot resolve relative imports.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from distnorm.collectives.layout import (DEVICE_ERROR_WORD, ERROR_MISMATCH, ERROR_TIMEOUT,
                                         FLAG_SLOTS, FLAG_WORDS, MAX_CTAS, MAX_WORLD)
from distnorm.kernels.ptx import inline_asm, ir_i32, ir_i64

__all__ = [
    "ld_acquire_sys_u32", "ld_relaxed_sys_u32", "ld_volatile_sys_u32", "st_release_sys_u32",
    "st_relaxed_sys_u32", "st_volatile_u32", "ld_weak_u32", "st_weak_u32", "atomic_cas_sys_u32",
    "atomic_add_gpu_u32",
    "atom_add_acq_rel_gpu_u32", "red_add_release_sys_u32", "fence_acq_rel_sys", "globaltimer_ns",
    "ld_volatile_sys_v4_u32",
    "st_volatile_sys_v4_u32", "ld_weak_v4_u32", "st_weak_v4_u32", "ld_acquire_sys_u32x2",
    "st_release_sys_u32x2", "cta_barrier",
    "record_timeout", "record_mismatch", "gave_up", "must_stop", "barrier_or", "SPIN_CHECK_MASK",
]

SPIN_CHECK_MASK = 255  # spinning threads look at %globaltimer and the device error word every 256 polls


# --- primitives -------------------------------------------------------------------------------
def _asm(ret_type, args, text: str, constraints: str, side_effects: bool = True):
    # every primitive here orders memory: side effects on by default
    return inline_asm(ret_type, args, text, constraints, side_effects)


def _load_u32(text: str):
    """A u32 load primitive f(addr) -> Int32 running `text` ($0 = value, $1 = address)."""
    @dsl_user_op
    def load(addr, *, loc=None, ip=None) -> Int32:
        return Int32(_asm(T.i32(), [ir_i64(addr, loc, ip)], text, "=r,l,~{memory}"))
    return load


def _store_u32(text: str):
    """A u32 store / reduction primitive f(addr, v) running `text` ($0 = address, $1 = value)."""
    @dsl_user_op
    def store(addr, v, *, loc=None, ip=None) -> None:
        _asm(None, [ir_i64(addr, loc, ip), ir_i32(v, loc, ip)], text, "l,r,~{memory}")
    return store


ld_acquire_sys_u32 = _load_u32("ld.acquire.sys.global.u32 $0, [$1];")
ld_relaxed_sys_u32 = _load_u32("ld.relaxed.sys.global.u32 $0, [$1];")
ld_volatile_sys_u32 = _load_u32("ld.volatile.global.u32 $0, [$1];")
st_release_sys_u32 = _store_u32("st.release.sys.global.u32 [$0], $1;")
st_relaxed_sys_u32 = _store_u32("st.relaxed.sys.global.u32 [$0], $1;")
st_volatile_u32 = _store_u32("st.volatile.global.u32 [$0], $1;")
# weak: for a CTA's own data after a CTA barrier, and for stores read after the kernel (NOTE
# [swizzled scales gathered] in kernels/reducescatter.py)
ld_weak_u32 = _load_u32("ld.global.u32 $0, [$1];")
st_weak_u32 = _store_u32("st.global.u32 [$0], $1;")
# fire-and-forget atomic add at GPU scope (counters read by the host after synchronize)
atomic_add_gpu_u32 = _store_u32("red.relaxed.gpu.global.add.u32 [$0], $1;")
# a count a peer acquires (NOTE [reduce-scatter roles by TMA] in kernels/rolespush.py)
red_add_release_sys_u32 = _store_u32("red.release.sys.global.add.u32 [$0], $1;")


@dsl_user_op
def atomic_cas_sys_u32(addr, compare, value, *, loc=None, ip=None) -> Int32:
    """Atomic compare-and-swap at system scope; returns the old value (swap happened iff == compare)."""
    return Int32(_asm(T.i32(), [ir_i64(addr, loc, ip), ir_i32(compare, loc, ip), ir_i32(value, loc, ip)],
                      "atom.relaxed.sys.global.cas.b32 $0, [$1], $2, $3;", "=r,l,r,r,~{memory}"))


@dsl_user_op
def atom_add_acq_rel_gpu_u32(addr, v, *, loc=None, ip=None) -> Int32:
    """atom.acq_rel.gpu.global.add.u32: returns the old value."""
    return Int32(_asm(T.i32(), [ir_i64(addr, loc, ip), ir_i32(v, loc, ip)],
                      "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r,~{memory}"))


@dsl_user_op
def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
    _asm(None, [], "fence.acq_rel.sys;", "~{memory}")


@dsl_user_op
def globaltimer_ns(*, loc=None, ip=None) -> Int64:
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l"))


def _load_v4(text: str, doc: str):
    """A 128-bit load primitive f(addr) -> 4 x Int32 running `text` ($0-$3 values, $4 address)."""
    @dsl_user_op
    def load(addr, *, loc=None, ip=None):
        st = llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])
        res = _asm(st, [ir_i64(addr, loc, ip)], text, "=r,=r,=r,=r,l,~{memory}")
        return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))
    load.__doc__ = doc
    return load


def _store_v4(text: str, doc: str):
    """A 128-bit store primitive f(addr, a, b, c, d) running `text` ($0 address, $1-$4 values)."""
    @dsl_user_op
    def store(addr, a, b, c, d, *, loc=None, ip=None) -> None:
        _asm(None, [ir_i64(addr, loc, ip), ir_i32(a, loc, ip), ir_i32(b, loc, ip),
                    ir_i32(c, loc, ip), ir_i32(d, loc, ip)], text, "l,r,r,r,r,~{memory}")
    store.__doc__ = doc
    return store


ld_volatile_sys_v4_u32 = _load_v4(
    "ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$4];",
    "128-bit volatile load (bypasses L1; sees peers' stores without caching). Returns 4 Int32.")
st_volatile_sys_v4_u32 = _store_v4("st.volatile.global.v4.u32 [$0], {$1, $2, $3, $4};",
                                   "128-bit volatile store (16-byte aligned address).")
# weak: a CTA's own stores read after its barrier, and stores ordered by a later barrier's release
# or read after the kernel (NOTE [weak gather copies] in kernels/reducescatter.py)
ld_weak_v4_u32 = _load_v4("ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "128-bit weak load.")
st_weak_v4_u32 = _store_v4("st.global.v4.u32 [$0], {$1, $2, $3, $4};", "128-bit weak store.")


@dsl_user_op
def ld_acquire_sys_u32x2(addr, *, loc=None, ip=None):
    """64-bit acquire load (8-byte aligned; single-copy atomic) returned as (low, high) Int32."""
    st = llvm.StructType.get_literal([T.i32(), T.i32()])
    res = _asm(st, [ir_i64(addr, loc, ip)],
               "{ .reg .b64 t; ld.acquire.sys.global.u64 t, [$2]; mov.b64 {$0, $1}, t; }",
               "=r,=r,l,~{memory}")
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def st_release_sys_u32x2(addr, lo, hi, *, loc=None, ip=None) -> None:
    """64-bit release store of (lo, hi) (8-byte aligned; single-copy atomic)."""
    _asm(None, [ir_i64(addr, loc, ip), ir_i32(lo, loc, ip), ir_i32(hi, loc, ip)],
         "{ .reg .b64 t; mov.b64 t, {$1, $2}; st.release.sys.global.u64 [$0], t; }",
         "l,r,r,~{memory}")


@dsl_user_op
def barrier_or(pred, *, loc=None, ip=None) -> Int32:
    """bar.red.or.pred over the whole CTA (barrier 0, a bar.sync with the same memory ordering):
    1 on every thread if ``pred`` != 0 on any thread, else 0."""
    return Int32(_asm(T.i32(), [ir_i32(pred, loc, ip)],
                      "{ .reg .pred dn_in, dn_out; setp.ne.s32 dn_in, $1, 0; "
                      "bar.red.or.pred dn_out, 0, dn_in; selp.s32 $0, 1, 0, dn_out; }",
                      "=r,r,~{memory}"))


# --- the barrier ------------------------------------------------------------------------------
@cute.jit
def _record_error(err_addr: Int64, dev_err_addr: Int64, code: cutlass.Constexpr[int], peer: Int32,
                  detail: Int32, value: Int32):
    """The first thread to fail records (code, peer, detail, value) in the pinned error words the
    host reads; every one sets the device error word the other waiters poll."""
    if atomic_cas_sys_u32(err_addr, Int32(0), Int32(code)) == Int32(0):
        st_volatile_u32(err_addr + Int64(4), peer)
        st_volatile_u32(err_addr + Int64(8), detail)
        st_volatile_u32(err_addr + Int64(12), value)
    st_volatile_u32(dev_err_addr, Int32(code))


@cute.jit
def record_timeout(err_addr: Int64, dev_err_addr: Int64, peer: Int32, epoch: Int32):
    """A waiting thread gives up on `peer` (layout: ERR_EPOCH = epoch / lamport area)."""
    _record_error(err_addr, dev_err_addr, ERROR_TIMEOUT, peer, epoch, Int32(0))


@cute.jit
def record_mismatch(err_addr: Int64, dev_err_addr: Int64, peer: Int32, word: Int32, value: Int32):
    """`peer` launched with another call descriptor: descriptor word `word` (-1: the signature)
    is `value` there (collectives/signature.py)."""
    _record_error(err_addr, dev_err_addr, ERROR_MISMATCH, peer, word, value)


@cute.jit
def must_stop(t0: Int64, timeout: Int64, err_addr: Int64, dev_err_addr: Int64, peer: Int32,
              epoch: Int32) -> Int32:
    """A spinning wait's check when it is due: 1 when it must stop -- another wait already failed
    (the device error word is set) or this one has waited `timeout` ns since t0 (then recorded as
    a timeout on `peer`, record_timeout) -- else 0."""
    stop = Int32(0)
    if ld_volatile_sys_u32(dev_err_addr) != Int32(0):
        stop = Int32(1)  # another thread / CTA already failed: stop too
    else:
        if globaltimer_ns() - t0 > timeout:
            record_timeout(err_addr, dev_err_addr, peer, epoch)
            stop = Int32(1)
    return stop


@cute.jit
def gave_up(spins: Int32, t0: Int64, timeout: Int64, err_addr: Int64, dev_err_addr: Int64,
            peer: Int32, epoch: Int32) -> Int32:
    """must_stop, due every SPIN_CHECK_MASK + 1 spins (else 0)."""
    stop = Int32(0)
    if (spins & Int32(SPIN_CHECK_MASK)) == Int32(0):
        stop = must_stop(t0, timeout, err_addr, dev_err_addr, peer, epoch)
    return stop


@cute.jit
def cta_barrier(signal_ptrs: cute.Tensor, rank: Int32, world: cutlass.Constexpr[int],
                region_word: cutlass.Constexpr[int], block: Int32, timeout: Int64, err: cute.Tensor,
                signature: Int32 = 0) -> Int32:
    """Barrier between the CTAs with index ``block`` on every rank; all threads of the CTA call it.
    Returns 0, or 1 on every thread of the CTA when it failed (this rank was already failed, a
    peer timed out or launched another call): the caller then writes nothing more to its peers.

    signal_ptrs: Int64 [world] device tensor of every rank's signal-pad base address (peer mapped).
    rank / world: this rank, group size (world <= MAX_WORLD, compile-time).
    region_word: first u32 word of this kernel's barrier region in every signal pad (compile-time).
    block: the CTA index (< MAX_CTAS); the same index on every rank meets here.
    timeout: give up after this many ns without a peer's flag (``Tuning.timeout_ns`` on the host).
    err: Int32 [4] error words (``Workspace.error_flag``, pinned host memory, viewed from the GPU):
         on timeout [0] = 1 (timeout), [1] = the peer waited on, [2] = the epoch; on a signature
         mismatch [0] = 2, [1] = the peer, [2] = -1, [3] = its signature; first writer wins.
    signature: 32-bit call signature (collectives/signature.py); every rank must pass the same.

    Algorithm: thread t < world reads epoch = epochs[block] + 1 (relaxed load: only this CTA
    writes it) and the device error word; bar.sync; thread t stores the 64-bit flag (epoch,
    signature) with st.release.sys into rank t's flags[block][rank][epoch % 2], polls its own
    flags[block][t][epoch % 2] with ld.acquire.sys until (int32)(v.epoch - epoch) >= 0, records a
    mismatch if v.signature differs from its own, and writes epoch back to epochs[block]; bar.red
    (a bar.sync that also ORs the threads' failures). The signature costs no memory access: it
    rides in the flag's upper half.

    Why two slots: a peer that passed this barrier (it needs only our flag) may arrive at the next
    one, maybe of the next call, before we have read its flag. With one slot it overwrote the flag
    we were about to read: a spurious mismatch (the next call's signature), or a missed one. With a
    slot per epoch parity it writes the other slot, and it cannot reach epoch + 2 (our slot again)
    without our flag for epoch + 1, which we write only after reading this one.

    NOTE [a failed rank arrives nowhere]: when this rank's device error word is set (a wait gave
    up, or a mismatch), it writes no flag, so every peer waiting on it fails too (timeout) instead
    of passing a barrier that this rank did not really keep, and reading data it did not write.
    The kernels add the other half: after a failed barrier, and in a launch that finds the error
    word set, they write nothing to peer memory.

    Memory-ordering guarantees:
    - Every write made before the barrier by any thread of this CTA (to local or peer memory) is
      visible to every thread of the same-index CTA on every rank after its barrier returns:
      bar.sync orders the CTA's writes before thread t's release store (release is cumulative in
      the PTX model: it covers writes that happen-before it, including other threads' via bar.sync);
      the peer's acquire load that reads the flag synchronizes-with it, and the peer's closing
      bar.sync extends that to all its threads.
    - No thread of this CTA returns before every rank's CTA ``block`` has entered the barrier of the
      same epoch, so reads made before the barrier are complete everywhere before any peer writes
      after it (write-after-read safety, used by the double-buffered data slots).
    - Only CTAs with the same index are ordered. There is no grid-wide ordering: a kernel must map
      its work so that CTA b on each rank only consumes/overwrites data produced/read by CTA b on
      the peers (same grid on all ranks). For a grid-wide barrier, call this after a local grid
      sync, or have one CTA index own the exchange.

    Why graph-safe and repeat-safe: the epoch counter lives in device memory (the signal pad), not in
    a kernel argument, so a CUDA-graph replay or a back-to-back launch continues from the stored
    epoch and never re-uses a value a stale flag could match. A peer can be at most one epoch ahead
    (it cannot pass epoch e+1 without our flag for e+1), so our slot holds epoch - 2 or epoch and
    the signed 32-bit difference test survives wrap-around of the counter.

    On timeout the thread records the error (if err[0] was 0) and sets this rank's device error word
    (layout.DEVICE_ERROR_WORD); other waiters poll that word (never the pinned err, which is
    slow to read from the GPU) at their next timer check and stop too, so a dead peer costs
    the timeout once, not per barrier. After a timeout the ranks' epochs are out of step: reset the
    region on every rank (``AllReduceState.reset``) before reusing it.
    """
    tidx, _, _ = cute.arch.thread_idx()
    epochs_word = Int64(region_word) + Int64(block)
    flags_word = Int64(region_word + MAX_CTAS) + Int64(block) * Int64(MAX_WORLD * FLAG_SLOTS * FLAG_WORDS)
    # Address, epoch and error-word loads are issued before the first bar.sync so their latency
    # overlaps it. Each waiting thread writes the new epoch back itself (all write the same value)
    # and reads it again only in program order after its own write, so no extra CTA barrier is
    # needed for it.
    local_base = signal_ptrs[rank]
    epoch_addr = local_base + epochs_word * Int64(4)
    dev_err_addr = local_base + Int64(DEVICE_ERROR_WORD * 4)
    peer_base = Int64(0)
    epoch = Int32(0)
    failed = Int32(0)
    if tidx < world:
        peer_base = signal_ptrs[tidx]
        epoch = ld_relaxed_sys_u32(epoch_addr) + Int32(1)
        failed = ld_volatile_sys_u32(dev_err_addr)
    cute.arch.barrier()  # every thread's earlier writes are done (ordered before the release below)
    if tidx < world:
        if failed == Int32(0):  # NOTE [a failed rank arrives nowhere]
            slot = Int64((epoch & Int32(FLAG_SLOTS - 1)) * Int32(FLAG_WORDS))
            st_release_sys_u32x2(
                peer_base + (flags_word + Int64(rank * FLAG_SLOTS * FLAG_WORDS) + slot) * Int64(4),
                epoch, Int32(signature))
            flag_addr = local_base + (flags_word + Int64(tidx * FLAG_SLOTS * FLAG_WORDS) + slot) * Int64(4)
            err_addr = err.iterator.toint()
            v, peer_sig = ld_acquire_sys_u32x2(flag_addr)
            waiting = Int32(0)  # Int32 flag, not bool: loop-carried values keep one DSL type
            if (v - epoch) < Int32(0):
                waiting = Int32(1)
            spins = Int32(0)
            t0 = globaltimer_ns()
            while waiting != Int32(0):
                v, peer_sig = ld_acquire_sys_u32x2(flag_addr)
                if (v - epoch) >= Int32(0):
                    waiting = Int32(0)
                spins = spins + Int32(1)
                # gave_up's gate written out (its call here compiles to other PTX, and this
                # barrier is what every GPU run so far has measured), then its due check
                if (spins & Int32(SPIN_CHECK_MASK)) == Int32(0):
                    if waiting != Int32(0):
                        if must_stop(t0, timeout, err_addr, dev_err_addr, tidx, epoch) != Int32(0):
                            waiting = Int32(0)
            if (v - epoch) >= Int32(0):
                if peer_sig != Int32(signature):
                    record_mismatch(err_addr, dev_err_addr, tidx, Int32(-1), peer_sig)
                    failed = Int32(1)
            else:
                failed = Int32(1)  # gave up waiting
            st_relaxed_sys_u32(epoch_addr, epoch)
    return barrier_or(failed)
