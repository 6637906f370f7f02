"""Where everything lives in a workspace: the signal-pad regions, the device error word, the pinned
error words and the split of the data buffer. Pure Python (no torch, CUDA or CuTe): imported by
``distnorm.comm`` (the workspace), the host ops and the kernels alike, so each number has one home.

Signal pad (per rank, ``Workspace.signal_bytes``, u32 words), regions of ``REGION_WORDS`` words:

    region 0  REGION_BARRIER_TEST  the barrier self-test kernel (tests/barrier_kernel.py)
    region 1  REGION_ONESHOT       one-shot's cross-rank CTA barrier
    region 2  REGION_TWOSHOT       two-shot's cross-rank CTA barrier
    region 3  REGION_LAMPORT       lamport's call state (LAMPORT_W_* words below)
    region 4  REGION_DEVICE_ERROR  word 0: the device error word (DEVICE_ERROR_WORD), then the
                                   call words (CALL_W_* below)
    region 5  REGION_REDUCESCATTER the sequence-parallel reduce-scatter's cross-rank CTA barrier
    region 6  REGION_ROWGATHER     the row gather's cross-rank CTA barrier (kernels/rowgather.py)
    region 7  REGION_ROLES         the reduce-scatter "roles-tma"'s epochs, counts and flags
                                   (ROLES_W_* below; ROLES_WORDS, not a whole region: the pad
                                   stays within the Workspace's default 1 MiB)

A barrier region holds ``epochs[MAX_CTAS]`` then 64-bit ``flags[MAX_CTAS][MAX_WORLD][FLAG_SLOTS]``,
each flag (epoch, call signature) in slot ``epoch % FLAG_SLOTS`` (kernels/sync.py: a peer one
barrier ahead writes the other slot, so it never overwrites the flag we have yet to read).
Each algorithm owns its region: two kernels on one region would advance each other's epochs.
Append new regions; never reuse an index.

Device error word: a kernel that times out sets it (beside the pinned words); spinning threads poll
it to give up early. They never poll the pinned words: a GPU read of host memory is slow in a VM, and
polling it made every wait that reached the check late enough to trigger it on the peers too.

Pinned error words (``Workspace.error_flag``, int32 [ERROR_WORDS] in host memory): [ERR_CODE] =
error code (ERROR_*), [ERR_PEER] = the rank waited on or disagreed with, [ERR_EPOCH] = the epoch /
lamport area (timeout) or the index of the call-descriptor word that differs (mismatch; -1: only the
signatures were compared), [ERR_VALUE] = the peer's value of that word (or its signature).

Call words (region 4, after the device error word; collectives/signature.py says what they hold):
CALL_W_LAST = the 4 descriptor words of this rank's last all-reduce launch (written by the kernel,
read by the host to say what differs when a call fails); CALL_W_LAMPORT_HDR + (k * MAX_WORLD + s) * 4
= the descriptor that rank s pushed with its rows into lamport area k (sentinel when empty);
CALL_W_HOST_BARRIER + b * MAX_WORLD + s = the epoch of rank s's last arrival at host barrier b
(HOST_BARRIER_FIRST_CALL: the first lamport call; HOST_BARRIER_RESET_A / _B: the two of reset;
collectives/faults.py).

Data buffer (per rank, ``Workspace.buffer_bytes``)::

    [0, half)                     pushed before a call's first barrier: one-shot slots, two-shot
                                  and reduce-scatter scatter slots, the row gather's areas
    [half, general)               written only after a call's first barrier: two-shot's gathered h
                                  (and T(acc)); NOTE [push and gather halves]
    [general + k * area, +area)   lamport area k = 0, 1, 2, each [world slots][rows][H] of T

``lamport_split(buffer_bytes)`` gives (general, area): the lamport areas take about a quarter, every
boundary 16-byte aligned, fixed per buffer size, so algorithms can be mixed call by call;
``push_half(general)`` gives half.

NOTE [push and gather halves]
A peer that finished a call starts its next one while we may still be in our last phase of the
same call; its pushes before that next call's first barrier (one-shot, two-shot's push form,
reduce-scatter, the row gather) may land in our buffer then. Two-shot's last phase reads gathered
rows (ours, or in the pull forms the owners'), so those rows live where no such push reaches: the
upper half. Everything written into a buffer after a call's first barrier is safe there (that
barrier needs our flag, which we write only after our previous kernel ended), so two-shot needs no
third barrier (NOTE [two-shot final barrier] in kernels/twoshot.py). One-shot and reduce-scatter
read their pushed slots after their barrier, in the lower half, so they keep their final barrier.

Lamport call state (region 3, this rank's pad only): word LAMPORT_W_AREA = area index of the next
call, LAMPORT_W_ARRIVE = CTA arrival counter of the running call, LAMPORT_W_VECS + k = 16-byte
vectors per slot the last call that used area k wrote there. An empty area holds LAMPORT_SENTINEL in
every 32-bit word (NOTE [lamport sentinel] in kernels/allreduce.py).
"""
from __future__ import annotations

__all__ = [
    "MAX_CTAS", "MAX_WORLD", "REGION_WORDS", "REGION_BARRIER_TEST", "REGION_ONESHOT",
    "REGION_TWOSHOT", "REGION_LAMPORT", "REGION_DEVICE_ERROR", "REGION_REDUCESCATTER",
    "REGION_ROWGATHER", "REGION_ROLES", "ROLES_W_EPOCH", "ROLES_W_ARRIVE", "ROLES_W_EXPECT",
    "ROLES_W_DONE", "ROLES_W_FLAGS", "ROLES_WORDS", "ROLES_FLAG_WORDS",
    "region_word", "DEVICE_ERROR_WORD",
    "MIN_SIGNAL_BYTES", "ERROR_NONE", "ERROR_TIMEOUT", "ERROR_MISMATCH", "ERROR_NAMES",
    "ERROR_WORDS", "ERR_CODE", "ERR_PEER", "ERR_EPOCH", "ERR_VALUE", "FLAG_WORDS", "FLAG_SLOTS",
    "DESCRIPTOR_WORDS",
    "CALL_W_LAST", "CALL_W_LAMPORT_HDR", "CALL_W_HOST_BARRIER", "HOST_BARRIER_FIRST_CALL",
    "HOST_BARRIER_RESET_A", "HOST_BARRIER_RESET_B", "LAMPORT_AREAS", "LAMPORT_SENTINEL", "LAMPORT_SENTINEL_I32",
    "LAMPORT_W_AREA", "LAMPORT_W_ARRIVE", "LAMPORT_W_VECS", "LAMPORT_STATE_WORDS",
    "lamport_split", "buffer_for_lamport", "push_half", "check_signal_pad",
]

MAX_CTAS = 1024   # CTA indices a barrier region has epochs and flags for
MAX_WORLD = 8     # ranks a barrier region has flags for
FLAG_WORDS = 2    # a flag is (epoch, signature): one 64-bit word
FLAG_SLOTS = 2    # flags of even and odd epochs (a power of two: kernels take epoch & (FLAG_SLOTS - 1))
REGION_WORDS = MAX_CTAS + MAX_CTAS * MAX_WORLD * FLAG_SLOTS * FLAG_WORDS  # 33792 words = 132 KiB

REGION_BARRIER_TEST = 0
REGION_ONESHOT = 1
REGION_TWOSHOT = 2
REGION_LAMPORT = 3
REGION_DEVICE_ERROR = 4
REGION_REDUCESCATTER = 5
REGION_ROWGATHER = 6
REGION_ROLES = 7
# NOTE [reduce-scatter roles by TMA] in kernels/rolespush.py: EPOCH = this rank's last call's epoch,
# ARRIVE = CTAs of the running call that read it, EXPECT = the completion counts wanted after the
# last call, DONE + s = how many of rank s's finisher CTAs have read all I pushed them (ever),
# FLAGS + (chunk * world + s) * 2 = the 64-bit flag (epoch, signature) of rank s's pushes of a chunk
ROLES_W_EPOCH, ROLES_W_ARRIVE, ROLES_W_EXPECT, ROLES_W_DONE, ROLES_W_FLAGS = 0, 1, 2, 16, 32
ROLES_WORDS = (1 << 18) - REGION_ROLES * REGION_WORDS  # up to 1 MiB of pad in all
ROLES_FLAG_WORDS = ROLES_WORDS - ROLES_W_FLAGS


def region_word(region: int) -> int:
    """First u32 word of signal-pad region ``region``."""
    return region * REGION_WORDS


LAMPORT_AREAS = 3  # rotating lamport areas of the data buffer (see below)
DEVICE_ERROR_WORD = region_word(REGION_DEVICE_ERROR)
DESCRIPTOR_WORDS = 4
CALL_W_LAST = DEVICE_ERROR_WORD + 4          # 16-byte aligned
CALL_W_LAMPORT_HDR = CALL_W_LAST + DESCRIPTOR_WORDS
CALL_W_HOST_BARRIER = CALL_W_LAMPORT_HDR + LAMPORT_AREAS * MAX_WORLD * DESCRIPTOR_WORDS
HOST_BARRIER_FIRST_CALL, HOST_BARRIER_RESET_A, HOST_BARRIER_RESET_B = 0, 1, 2
MIN_SIGNAL_BYTES = (region_word(REGION_ROLES) + ROLES_WORDS) * 4  # every region (the last: 7) fits

# pinned error words
ERROR_NONE = 0
ERROR_TIMEOUT = 1   # a device-side wait on a peer gave up
ERROR_MISMATCH = 2  # a peer launched the same algorithm with another call descriptor
ERROR_NAMES = {ERROR_NONE: "none", ERROR_TIMEOUT: "timeout", ERROR_MISMATCH: "mismatch"}
ERROR_WORDS = 4
ERR_CODE, ERR_PEER, ERR_EPOCH, ERR_VALUE = 0, 1, 2, 3

# lamport (LAMPORT_AREAS above)
LAMPORT_SENTINEL = 0xFFFFFFFF   # every 32-bit word of an empty area
LAMPORT_SENTINEL_I32 = -1       # the same bits as a signed 32-bit value
LAMPORT_W_AREA, LAMPORT_W_ARRIVE, LAMPORT_W_VECS = 0, 1, 2
LAMPORT_STATE_WORDS = LAMPORT_W_VECS + LAMPORT_AREAS
_LAMPORT_FRACTION = 4  # the lamport areas take 1/_LAMPORT_FRACTION of the data buffer


def lamport_split(buffer_bytes: int) -> tuple[int, int]:
    """(general, area): bytes of the data buffer left to one-shot / two-shot at its start, and the
    size of each of the three lamport areas after them (all multiples of 16)."""
    area = buffer_bytes // _LAMPORT_FRACTION // LAMPORT_AREAS // 16 * 16
    general = (buffer_bytes - LAMPORT_AREAS * area) // 16 * 16
    return general, area


def buffer_for_lamport(call_bytes: int, world: int) -> int:
    """The smallest data buffer whose lamport areas each hold one call of ``call_bytes`` bytes per
    rank at ``world`` ranks (a call that fits takes one lamport launch, not several)."""
    return LAMPORT_AREAS * _LAMPORT_FRACTION * (world * call_bytes + 16)


def push_half(general: int) -> int:
    """Bytes of the general part that pre-barrier pushes may use (NOTE [push and gather halves]):
    its lower half, 16-byte aligned; two-shot's gather areas take the rest."""
    return general // 2 // 16 * 16


def check_signal_pad(signal_bytes: int, world: int, ctas: int | None = None) -> None:
    """ValueError unless a signal pad of ``signal_bytes`` holds every region and the device error
    word, the group has at most MAX_WORLD ranks and ``ctas`` (when given) is in 1..MAX_CTAS."""
    if signal_bytes < MIN_SIGNAL_BYTES:
        raise ValueError(f"the all-reduce kernels need a signal pad of >= {MIN_SIGNAL_BYTES} bytes, "
                         f"the workspace has {signal_bytes}; create it with a larger signal_bytes")
    if world > MAX_WORLD:
        raise ValueError(f"the all-reduce kernels support at most {MAX_WORLD} ranks, the group has "
                         f"{world}")
    if ctas is not None and not 1 <= ctas <= MAX_CTAS:
        raise ValueError(f"the cross-rank barrier supports 1..{MAX_CTAS} CTAs, got {ctas}")

assert CALL_W_HOST_BARRIER + 3 * MAX_WORLD <= region_word(REGION_DEVICE_ERROR + 1)
assert ROLES_W_DONE + MAX_WORLD <= ROLES_W_FLAGS and ROLES_W_FLAGS % 2 == 0
