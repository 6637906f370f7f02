"""Device helpers of the Lamport one-shot all-reduce ("lamport"); the kernel body is
``AllReduceAddRMSNormQuant._lamport`` (kernels/allreduce.py). Where its three rotating areas and its
call state live is ``distnorm.collectives.layout``; filling them on the host is
``distnorm.collectives.state``.

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
"""
from __future__ import annotations

from cutlass import Int32

__all__ = ["sanitize_word"]


def sanitize_word(w):
    """Rewrite each 16-bit half equal to 0xFFFF into 0x7FFF (NOTE [lamport sentinel]); the result is
    never 0xFFFFFFFF. Branch-free Int32 arithmetic (device code)."""
    lo = Int32((w & 0xFFFF) == 0xFFFF)
    hi = Int32((w >> 16) == Int32(-1))  # arithmetic shift: -1 iff the high half is 0xFFFF
    return w ^ (lo << 15) ^ (hi << 31)
