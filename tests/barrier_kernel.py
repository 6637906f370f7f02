"""Test / benchmark kernel for ``sync.cta_barrier``: many barrier rounds in one launch (used by
tests/multigpu/test_barrier_gpu.py, tests/test_sync_compile.py and benchmarks/bench_barrier.py).

Mode "check" (default): each round r, CTA b on rank q writes a (r, q, b, thread)-dependent int32
pattern into slot [r % 2][b][q] of its LOCAL data buffer (``buffer_ptrs[rank]``), calls the barrier,
then reads slot [r % 2][b][p] of every rank p through ``buffer_ptrs[p]`` (plain loads) and counts
values that differ from the expected pattern into ``out[0]``.

Why two alternating slots make one barrier per round enough: after barrier r, rank q writes slot
(r + 1) % 2 in round r + 1, which nobody reads in round r. It writes slot r % 2 again only in round
r + 2, i.e. after passing barrier r + 1, which no peer enters before it finished its round-r reads
of that slot. With one slot a fast rank would overwrite data a slow peer is still reading (a second
barrier per round would be needed).

Mode "barrier_only": just ``rounds`` barriers back to back (latency measurement).

Data layout in the buffer (int32 words): [2][ctas][world][THREADS], one word per thread.
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from distnorm.collectives.layout import (ERROR_WORDS, MAX_WORLD, REGION_BARRIER_TEST,
                                         check_signal_pad, region_word)
from distnorm.collectives.plan import Tuning
from distnorm.kernels import compat, sync

THREADS = 128
REGION = region_word(REGION_BARRIER_TEST)


def buffer_bytes_needed(ctas: int, world: int) -> int:
    return 2 * ctas * world * THREADS * 4


class BarrierRounds:
    """Compiled once per (world, mode); ctas, rounds, rank and the timeout are run-time values."""

    def __init__(self, world: int, barrier_only: bool = False, region_word: int = REGION):
        assert 1 <= world <= MAX_WORLD
        self.world = world
        self.barrier_only = barrier_only
        self.region_word = region_word

    @cute.jit
    def __call__(self, buffer_ptrs: cute.Tensor, signal_ptrs: cute.Tensor, err: cute.Tensor,
                 out: cute.Tensor, rank: Int32, ctas: Int32, rounds: Int32, timeout_ns: Int64,
                 stream):
        self.kernel(buffer_ptrs, signal_ptrs, err, out, rank, ctas, rounds, timeout_ns).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, buffer_ptrs: cute.Tensor, signal_ptrs: cute.Tensor, err: cute.Tensor,
               out: cute.Tensor, rank: Int32, ctas: Int32, rounds: Int32, timeout_ns: Int64):
        world = self.world
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bad = Int32(0)
        for r in cutlass.range(rounds, unroll=1):
            if const_expr(self.barrier_only):
                sync.cta_barrier(signal_ptrs, rank, world, self.region_word, bidx, timeout_ns, err)
            else:
                slot = r % Int32(2)
                # word index of slot [slot][bidx][q][tidx] is ((slot*ctas + bidx)*world + q)*THREADS + tidx
                row = (slot * ctas + bidx) * Int32(world)
                mine = Int64((row + rank) * Int32(THREADS) + tidx) * Int64(4)
                sync.st_relaxed_sys_u32(buffer_ptrs[rank] + mine, self.pattern(r, rank, bidx, tidx))
                sync.cta_barrier(signal_ptrs, rank, world, self.region_word, bidx, timeout_ns, err)
                for p in cutlass.range_constexpr(world):
                    off = Int64((row + Int32(p)) * Int32(THREADS) + tidx) * Int64(4)
                    ptr = cute.make_ptr(Int32, buffer_ptrs[p] + off, cute.AddressSpace.gmem,
                                        assumed_align=4)
                    got = cute.make_tensor(ptr, cute.make_layout(1))[0]  # a plain (weak) load
                    if got != self.pattern(r, Int32(p), bidx, tidx):
                        bad = bad + Int32(1)
        if bad != Int32(0):
            sync.atomic_add_gpu_u32(out.iterator.toint(), bad)

    @cute.jit
    def pattern(self, r: Int32, q: Int32, b: Int32, t: Int32) -> Int32:
        # distinct per (round, rank, cta, thread) within any window of rounds; never 0 for r >= 0
        return (r * Int32(1000003)) ^ (q * Int32(7919) + b * Int32(131) + t + Int32(1) + (q << 24))


@functools.cache
def compiled_barrier_rounds(world: int, barrier_only: bool = False):
    """f(buffer_ptrs, signal_ptrs, err, out, rank, ctas, rounds, timeout_ns); current torch stream."""
    kernel = BarrierRounds(world, barrier_only)
    ptrs = compat.make_fake_tensor(Int64, (world,), (1,), assumed_align=8)
    sigs = compat.make_fake_tensor(Int64, (world,), (1,), assumed_align=8)
    err = compat.make_fake_tensor(Int32, (4,), (1,), assumed_align=16)
    out = compat.make_fake_tensor(Int32, (1,), (1,), assumed_align=4)
    stream = compat.make_fake_stream(use_tvm_ffi_env_stream=True)
    return compat.compile_tvm_ffi(kernel, ptrs, sigs, err, out, Int32(0), Int32(1), Int32(1),
                                  Int64(1), stream)


class PrimitivesSmoke:
    """Exercises every sync primitive once (compile check of the 128-bit volatile ones used by the
    Lamport kernel); on a GPU: copies 16 bytes src -> dst and writes three flag words."""

    @cute.jit
    def __call__(self, src: Int64, dst: Int64, mFlag: cute.Tensor, stream):
        self.kernel(src, dst, mFlag).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: Int64, dst: Int64, mFlag: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        flag = mFlag.iterator.toint()
        if tidx == 0:
            a, b, c, d = sync.ld_volatile_sys_v4_u32(src)
            sync.st_volatile_sys_v4_u32(dst, a, b, c, d)
            sync.fence_acq_rel_sys()
            old = sync.atomic_cas_sys_u32(flag, Int32(0), a)
            sync.st_release_sys_u32(flag + Int64(4), old + sync.ld_acquire_sys_u32(flag + Int64(8)))
            sync.st_relaxed_sys_u32(flag + Int64(12), Int32(sync.globaltimer_ns() & Int64(0x7FFFFFFF)))
            sync.atomic_add_gpu_u32(flag + Int64(8), sync.ld_relaxed_sys_u32(flag))


@functools.cache
def compiled_primitives_smoke():
    """f(src_addr, dst_addr, flag) with 16-byte aligned addresses, flag an int32 [4] CUDA tensor."""
    stream = compat.make_fake_stream(use_tvm_ffi_env_stream=True)
    flag = compat.make_fake_tensor(Int32, (4,), (1,), assumed_align=16)
    return compat.compile_tvm_ffi(PrimitivesSmoke(), Int64(0), Int64(0), flag, stream)


# --- host helpers -----------------------------------------------------------------------------
def error_view(ws):
    """``ws.error_flag`` (pinned host memory) as a CUDA tensor of the local device (UVA address)."""
    import torch

    from distnorm.comm import tensor_from_ptr

    return tensor_from_ptr(ws.error_flag_ptr, ERROR_WORDS * 4, ws.device).view(torch.int32)


def timeout_ns(timeout_s: float | None = None) -> int:
    """timeout_s in ns, else the library's setting (DISTNORM_BARRIER_TIMEOUT_S, default 10 s)."""
    return Tuning.from_env().timeout_ns if timeout_s is None else Tuning(timeout_s=timeout_s).timeout_ns


def launch_barrier_rounds(ws, rounds: int, ctas: int = 1, timeout_s: float | None = None,
                          barrier_only: bool = False, out=None, err=None):
    """Enqueue one launch on the current stream (capturable); returns the mismatch counter tensor."""
    import torch

    check_signal_pad(ws.signal_bytes, ws.world_size, ctas)
    if not barrier_only and buffer_bytes_needed(ctas, ws.world_size) > ws.buffer_bytes:
        raise ValueError(f"{ctas} CTAs need a data region of {buffer_bytes_needed(ctas, ws.world_size)} "
                         f"bytes, workspace has {ws.buffer_bytes}")
    if out is None:
        out = torch.zeros(1, dtype=torch.int32, device=ws.device)
    if err is None:
        err = error_view(ws)
    f = compiled_barrier_rounds(ws.world_size, barrier_only)
    f(ws.buffer_ptrs, ws.signal_ptrs, err, out, ws.rank, ctas, rounds, timeout_ns(timeout_s))
    return out


def run_barrier_rounds(ws, rounds: int, ctas: int = 1, timeout_s: float | None = None,
                       barrier_only: bool = False) -> int:
    """Launch, synchronize, raise CommTimeoutError if a barrier timed out; returns the mismatches."""
    import torch

    out = launch_barrier_rounds(ws, rounds, ctas, timeout_s, barrier_only)
    torch.cuda.synchronize(ws.device)
    ws.raise_if_failed()
    return int(out.item())
