"""Lamport one-shot all-reduce ("lamport"): buffer layout, sentinel, device-side state, host setup.

The kernel body is ``AllReduceAddRMSNormQuant._lamport`` (kernels/allreduce.py); this module holds
what the op layer and the kernel share: where the three rotating areas live in the workspace's data
buffer, the sentinel, the signal-pad words that carry the call state, the PTX helpers the kernel
needs beyond sync.py, and the collective host-side (re)initialisation.

Buffer layout (per rank, in the workspace's data buffer of ``buffer_bytes``):

    [0, general)                     oneshot / twoshot data (their capacities use ``general`` bytes)
    [general + k * area, +area)      lamport area k = 0, 1, 2, each [N ranks][rows][H] of T
                                     (slot stride = the call's M rows: a call with M rows uses the
                                     first N * M * H elements of its area)

``lamport_layout(buffer_bytes)`` gives (general, area): the lamport areas take about a quarter of the
buffer, every boundary 16-byte aligned. The split is fixed per buffer size, so oneshot / twoshot never
touch the lamport areas and the algorithms can be mixed call by call without re-filling anything.

Sentinel (NOTE [lamport sentinel]): every 32-bit word of an unwritten area holds 0xFFFFFFFF, i.e. two
16-bit 0xFFFF values, a NaN in both bf16 and fp16. Before sending, a writer rewrites every 16-bit
element equal to 0xFFFF to 0x7FFF (also a NaN), so a written word never equals the sentinel and a
reader knows a word has arrived when it differs from it (32-bit accesses are single-copy atomic, so a
word is never seen half-written; 128-bit stores may land in 32-bit pieces, which is why every word is
checked). Why a NaN and not -0.0 (0x8000 per element, as CUTLASS's example uses): rewriting -0.0 to
+0.0 changes results (when every rank sends -0.0, the exact sum acc = -0.0 becomes +0.0, and h, y and
the quantized zero codes change sign), whereas any sum containing a NaN is the canonical NaN on the
GPU (float32 add returns 0x7FFFFFFF whatever the payloads), so rewriting one NaN payload into another
cannot change any output for world >= 2. With world 1 (no add) a 0xFFFF input becomes 0x7FFF, i.e.
the NaN's sign bit is dropped; nothing else changes.

Device state (signal pad region ``REGION`` = 3 of sync.py, this rank's pad only; see
NOTE [lamport call state] in kernels/allreduce.py): word 0 = area index k of the next call (0, 1, 2),
word 1 = CTA arrival counter of the running call, words 2..4 = 16-byte vectors per slot (M * H / 8)
the last call that used area 0 / 1 / 2 wrote there. All start at 0 (``reset``).
"""
from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from distnorm.kernels import sync  # absolute imports: the 4.3.5 DSL preprocessor needs them

__all__ = ["REGION", "AREAS", "SENTINEL", "SENTINEL_I32", "STATE_WORDS", "W_AREA", "W_ARRIVE",
           "W_ROWS", "lamport_layout", "capacity_rows", "reset", "area_ptr_table",
           "atom_add_acq_rel_gpu_u32", "sanitize_word"]

REGION = 3            # sync.py region index whose words hold the lamport state (see above)
AREAS = 3             # rotating areas
SENTINEL = 0xFFFFFFFF  # per 32-bit word of an empty area
SENTINEL_I32 = -1     # the same bits as a signed 32-bit value
W_AREA, W_ARRIVE, W_ROWS = 0, 1, 2  # word offsets inside the region (W_ROWS + k for area k)
STATE_WORDS = W_ROWS + AREAS
LAMPORT_FRACTION = 4  # the lamport areas take 1/LAMPORT_FRACTION of the data buffer


def lamport_layout(buffer_bytes: int) -> tuple[int, int]:
    """(general, area): bytes left to oneshot/twoshot at the start of the buffer, and the size of
    each of the three lamport areas that follow (all multiples of 16)."""
    area = buffer_bytes // LAMPORT_FRACTION // AREAS // 16 * 16
    general = (buffer_bytes - AREAS * area) // 16 * 16
    return general, area


def capacity_rows(world: int, hidden: int, elem_size: int, buffer_bytes: int) -> int:
    """Most rows one lamport call may take: world * rows * H * elem_size <= area bytes (exact)."""
    _, area = lamport_layout(buffer_bytes)
    return area // (world * hidden * elem_size)


def area_ptr_table(ws):
    """int64 [3 * world] device tensor: entry k * world + s = address of rank s's lamport area k."""
    import torch

    general, area = lamport_layout(ws.buffer_bytes)
    ptrs = [p + general + k * area for k in range(AREAS) for p in ws.buffer_ptrs_host]
    return torch.tensor(ptrs, dtype=torch.int64, device=ws.device)


def reset(ws) -> None:
    """Fill this rank's three lamport areas with the sentinel and zero the lamport state words, then
    wait for every rank to have done so. Collective: every rank calls it while no kernel of this
    workspace runs (first use, or after a timeout left the areas half written). Not during CUDA-graph
    capture."""
    import torch

    sync.check_region(ws, sync.region_word(REGION))
    general, area = lamport_layout(ws.buffer_bytes)
    words = ws.local_buffer(torch.int32, (ws.buffer_bytes // 4,))
    with torch.cuda.device(ws.device):
        words[general // 4:(general + AREAS * area) // 4].fill_(SENTINEL_I32)
        w0 = sync.region_word(REGION)
        ws.peer_signal(ws.rank)[w0:w0 + STATE_WORDS].zero_()
        torch.cuda.synchronize(ws.device)
    ws.barrier()


# --- device helpers ---------------------------------------------------------------------------
@dsl_user_op
def atom_add_acq_rel_gpu_u32(addr, v, *, loc=None, ip=None) -> Int32:
    """atom.acq_rel.gpu.global.add.u32: returns the old value."""
    return Int32(llvm.inline_asm(
        T.i32(), [sync._i64(addr, loc, ip), sync._i32(v, loc, ip)],
        "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def sanitize_word(w):
    """Rewrite each 16-bit half equal to 0xFFFF into 0x7FFF (NOTE [lamport sentinel]); the result is
    never 0xFFFFFFFF. Branch-free Int32 arithmetic (device code)."""
    lo = Int32((w & 0xFFFF) == 0xFFFF)
    hi = Int32((w >> 16) == Int32(-1))  # arithmetic shift: -1 iff the high half is 0xFFFF
    return w ^ (lo << 15) ^ (hi << 31)
