"""Measurement kernel for the reduce-scatter's push (issue 13's TMA lever, NOTE [reduce-scatter
rounds]): how many CTAs it takes to fill NVLink with a peer's buffer as the destination, when
the CTA's threads store 16-byte units (what the kernels do today: a pushing thread waits for its
stores and cannot run the epilogue meanwhile) against one thread per CTA issuing bulk copies
through the TMA (cp.async.bulk shared -> global, the copy engine moving the bytes while the
threads would be free). Used by benchmarks/bench_push.py and compiled on the CPU by
tests/test_sync_compile.py.

Modes (compile-time):
- "st": every thread copies 16-byte units from src to dst, grid-stride, UNROLL loads issued before
  their stores (NOTE [batched copies] in kernels/reducescatter.py);
- "tma": thread 0 of each CTA issues cp.async.bulk stores of CHUNK bytes from its shared memory to
  dst, grid-stride over the chunks, one bulk group each, and waits for them all before it exits.
  The shared memory is not filled from src: this measures the link side only;
- "tma-copy": the whole push through the TMA, src -> shared memory -> dst, in two stages of
  CHUNK / 2 bytes: chunk j + 1 is loaded (cp.async.bulk into shared memory, an mbarrier counting
  its bytes) while chunk j is stored, a stage reloaded only after the store that read it has read
  it (cp.async.bulk.wait_group.read).
The destination is any global address: a peer's workspace buffer (its contents are scratch).
The PTX is distnorm/kernels/bulk.py's, which the reduce-scatter's "pipelined-tma" form uses too.
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from distnorm.kernels import compat, sync
from distnorm.kernels.bulk import (bulk_load_g2s, bulk_store_s2g, bulk_wait_all, bulk_wait_read_all,
                                   fence_proxy_async_shared, mbar_init)
from distnorm.kernels.compat import SmemAllocator
from distnorm.kernels.ptx import mbarrier_try_wait

THREADS = 128
UNROLL = 4
CHUNK = 32 << 10  # bytes per bulk copy (static shared memory: under the 48 KiB default)
HALF = CHUNK // 2  # a stage of "tma-copy"
MODES = ("st", "tma", "tma-copy")


class PushBandwidth:
    """Compiled once per mode; src, dst, the byte count (a multiple of CHUNK) and the grid are
    run-time values."""

    def __init__(self, mode: str):
        assert mode in MODES, mode
        self.mode = mode

    @cute.jit
    def __call__(self, src: Int64, dst: Int64, nbytes: Int64, ctas: Int32, mAnchor: cute.Tensor,
                 stream):
        # mAnchor: any CUDA tensor (unused): the launcher finds the device and stream from it
        self.kernel(src, dst, nbytes).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1],
                                             stream=stream)

    @cute.kernel
    def kernel(self, src: Int64, dst: Int64, nbytes: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        if const_expr(self.mode == "st"):
            units = Int32(nbytes // Int64(16))
            step = nblk * Int32(THREADS * UNROLL)
            for base in cutlass.range(bidx * Int32(THREADS * UNROLL) + tidx, units, step,
                                      unroll=1):
                vals = [sync.ld_weak_v4_u32(src + Int64(base + Int32(k * THREADS)) * Int64(16))
                        for k in range(UNROLL)]
                for k in cutlass.range_constexpr(UNROLL):
                    a, b, c, d = vals[k]
                    sync.st_weak_v4_u32(dst + Int64(base + Int32(k * THREADS)) * Int64(16),
                                        a, b, c, d)
        elif const_expr(self.mode == "tma"):
            smem = SmemAllocator()
            stage = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(CHUNK), byte_alignment=128)
            if tidx == 0:
                stage_addr = stage.iterator.toint()  # a shared-space (32-bit) address
                chunks = Int32(nbytes // Int64(CHUNK))
                for c in cutlass.range(bidx, chunks, nblk, unroll=1):
                    bulk_store_s2g(dst + Int64(c) * Int64(CHUNK), stage_addr, Int32(CHUNK))
                bulk_wait_all()
        else:
            smem = SmemAllocator()
            stage = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(CHUNK), byte_alignment=128)
            mbars = smem.allocate_tensor(Int64, cute.make_layout(2), byte_alignment=8)
            if tidx == 0:
                stages = stage.iterator.toint()
                mbar = mbars.iterator.toint()
                mbar_init(mbar)
                mbar_init(mbar + Int32(8))
                chunks = Int32(nbytes // Int64(HALF))
                mine = Int32(0)  # my chunks: bidx, bidx + nblk, ...
                if bidx < chunks:
                    mine = (chunks - Int32(1) - bidx) // nblk + Int32(1)
                    bulk_load_g2s(stages, src + Int64(bidx) * Int64(HALF), Int32(HALF), mbar)
                for j in cutlass.range(mine, unroll=1):
                    s = j & Int32(1)
                    if j + Int32(1) < mine:  # the next chunk into the other stage
                        bulk_wait_read_all()  # the store that read that stage has read it
                        nxt = Int64(bidx + (j + Int32(1)) * nblk) * Int64(HALF)
                        bulk_load_g2s(stages + (Int32(1) - s) * Int32(HALF), src + nxt,
                                      Int32(HALF), mbar + (Int32(1) - s) * Int32(8))
                    ready = Int32(0)
                    while ready == Int32(0):
                        ready = mbarrier_try_wait(mbar + s * Int32(8), (j >> Int32(1)) & Int32(1))
                    fence_proxy_async_shared()
                    at = Int64(bidx + j * nblk) * Int64(HALF)
                    bulk_store_s2g(dst + at, stages + s * Int32(HALF), Int32(HALF))
                bulk_wait_all()


@functools.cache
def compiled_push(mode: str):
    """f(src_addr, dst_addr, nbytes, ctas, anchor) on the current torch stream; anchor: any int32
    CUDA tensor of the device."""
    stream = compat.make_fake_stream(use_tvm_ffi_env_stream=True)
    anchor = compat.make_fake_tensor(Int32, (1,), (1,), assumed_align=4)
    return compat.compile_tvm_ffi(PushBandwidth(mode), Int64(0), Int64(0), Int64(CHUNK),
                                  Int32(1), anchor, stream)
