"""Planning an all-reduce call: which algorithm, how many rows per launch, launch settings.

Pure Python (no torch): the registry of algorithms (ALGORITHMS), the measured crossover tables
`algo="auto"` chooses by, the per-launch row capacities that keep a launch inside its part of the
workspace's data buffer (layout.lamport_split), and the tuning knobs (Tuning, read from the
environment in Tuning.from_env and nowhere else).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from distnorm.collectives.layout import (LAMPORT_AREAS, REGION_LAMPORT, REGION_ONESHOT,
                                         REGION_REDUCESCATTER, REGION_ROWGATHER, REGION_TWOSHOT,
                                         lamport_split, push_half)

__all__ = ["Algorithm", "ALGORITHMS", "ALGOS", "ALGORITHM_FORMS", "AUTO_FORM", "GATHER_BY",
           "LAMPORT_FORMS", "SIZED_FORMS", "SIZED_ROWS_PER_CTA", "TUNING_FORMS", "WORLD_MAX_CTAS", "sized_form",
           "sized_ladder",
           "NOPEER_FORMS", "REDUCESCATTER_FORMS", "ROWGATHER_FORMS", "TWOSHOT_FORMS",
           "settings_ranks_share", "check_shared_settings",
           "Tuning", "choose_algo", "lamport_capacity",
           "max_chunk_rows", "plan_launch", "knob", "LAMPORT_CROSSOVER_BYTES", "LAMPORT_CROSSOVER_BYTES_PLAIN",
           "ONESHOT_CROSSOVER_BYTES"]

SWIZZLE_ROWS = 128  # swizzled scales come in 128-row tiles: chunks after the first start at multiples


def _slot_rows(world: int, row_bytes: int, part_bytes: int, gather_acc: bool, swizzled: bool) -> int:
    """lamport: world slots of the call's rows in one area."""
    return part_bytes // (world * row_bytes)


def _oneshot_rows(world: int, row_bytes: int, part_bytes: int, gather_acc: bool,
                  swizzled: bool) -> int:
    """one-shot: world slots of the call's rows in the lower half (NOTE [push and gather halves])."""
    return _slot_rows(world, row_bytes, push_half(part_bytes), gather_acc, swizzled)


def _twoshot_rows(world: int, row_bytes: int, part_bytes: int, gather_acc: bool, swizzled: bool) -> int:
    """two-shot: scatter [world][S] rows in the lower half, gather h [world * S] (+ gather acc
    [world * S]) rows in the upper (NOTE [push and gather halves]), S = ceil(rows / world), rows
    padded to 128 for swizzled scales (so the cap is a multiple of 128)."""
    lower = push_half(part_bytes)
    cap = min(lower // row_bytes,
              (part_bytes - lower) // ((1 + int(gather_acc)) * row_bytes)) - (world - 1)
    return cap // SWIZZLE_ROWS * SWIZZLE_ROWS if swizzled else cap


def _scatter_rows(world: int, row_bytes: int, part_bytes: int, gather_acc: bool,
                  swizzled: bool) -> int:
    """reduce-scatter (sequence-parallel): scatter [world][S] rows in the lower half, S =
    ceil(M / world)."""
    return world * (push_half(part_bytes) // (world * row_bytes))


@dataclass(frozen=True)
class Algorithm:
    """What the host needs to know of one all-reduce algorithm of kernels/allreduce.py.

    region: its signal-pad region (layout.REGION_*).
    lamport_part: True if it uses the three lamport areas of the data buffer (one per call), False if
      the general part before them.
    rows: (world, row_bytes, part_bytes, gather_acc, swizzled) -> most rows one launch may take.
    ptr_tables: peer-pointer table entries per rank (lamport: one per area; two-shot: the buffer
      and its upper half, NOTE [push and gather halves]).
    knob: whose Tuning knobs (form, rows per CTA, CTA cap) it takes ("" = its own name).
    """

    name: str
    region: int
    lamport_part: bool
    rows: Callable[[int, int, int, bool, bool], int]
    ptr_tables: int = 1
    knob: str = ""


ALGORITHMS = {
    "lamport": Algorithm("lamport", REGION_LAMPORT, True, _slot_rows, LAMPORT_AREAS),
    "oneshot": Algorithm("oneshot", REGION_ONESHOT, False, _oneshot_rows),
    # two tables: the buffers' bases, then their upper halves (the gather areas)
    "twoshot": Algorithm("twoshot", REGION_TWOSHOT, False, _twoshot_rows, 2),
    # the sequence-parallel op's kernel (collectives/seqpar.py), not an all-reduce algorithm
    "reducescatter": Algorithm("reducescatter", REGION_REDUCESCATTER, False, _scatter_rows),
    # the same with the quantized rows gathered in its epilogue (NOTE [gather in the epilogue] in
    # kernels/reducescatter.py): every rank's q areas in the upper half, hence two tables
    "rsgather": Algorithm("rsgather", REGION_REDUCESCATTER, False, _scatter_rows, 2,
                          "reducescatter"),
    # the sequence-parallel gathers through the peers (kernels/rowgather.py; row bytes: all its
    # segments' together)
    "rowgather": Algorithm("rowgather", REGION_ROWGATHER, False, _scatter_rows),
}
ALGOS = ("auto", "lamport", "oneshot", "twoshot")  # what allreduce ops take as `algo`


def knob(algo: str) -> str:
    """The algorithm whose Tuning knobs and forms `algo` takes (Algorithm.knob)."""
    alg = ALGORITHMS.get(algo)
    return alg.knob or alg.name if alg is not None else algo

# Crossovers in bytes per rank (M * H * element size), by world size.
# World 2: measured on 2 x H200 (NV18), benchmarks/results/allreduce_fusion_h200_x2.md, command
#   torchrun --nproc-per-node 2 benchmarks/bench_allreduce_fusion.py --out benchmarks/results/allreduce_fusion_h200_x2
#   fused fp8: lamport 17.6 us vs two-shot 22.2 at 4 MiB (512 x 4096); two-shot 34.2 vs lamport 35.3
#   at 8 MiB (512 x 8192), 61.2 vs 75.1 at 16 MiB: lamport up to 4 MiB. Plain all-reduce (no
#   epilogue): lamport 30.6 vs two-shot 33.1 at 8 MiB, two-shot 57.6 vs 64.7 at 16 MiB: lamport up
#   to 8 MiB. One-shot never wins.
# World 4: measured on 4 x H200 against the push-wide two-shot (2026-11-27, ninth session),
#   benchmarks/results/lamport_crossover_wide_h200_x4.md: fused fp8, lamport 10.9 us vs two-shot
#   11.6 at 512 KiB (64 x 4096; 10.5 vs 11.5 at 32 x 8192), two-shot 11.8 vs lamport 12.3 at 640 KiB
#   (80 x 4096) and 12.6 vs 14.1 at 768 KiB (48 x 8192): lamport up to 512 KiB; plain all-reduce
#   likewise (10.1 vs 10.1 at 512 KiB, 10.7 vs 11.5 at 640 KiB). (Against the default-grid two-shot
#   lamport won up to 896 KiB, lamport_crossover_h200_x4.md.)
# World 8: NOT measured (8-GPU machines were not lent): world 4's, to be replaced.
LAMPORT_CROSSOVER_BYTES = {2: 4 << 20, 4: 512 << 10, 8: 512 << 10}
LAMPORT_CROSSOVER_BYTES_PLAIN = {2: 8 << 20, 4: 512 << 10, 8: 512 << 10}  # distnorm.allreduce
# Bytes per rank up to which the barrier one-shot beats two-shot, for calls lamport does not take
# (beyond its crossover, or more rows than one lamport area holds). Fused FP8 against today's
# two-shot forms: world 2 (allreduce_fusion_wide_h200_x2.md) one-shot 8.1 vs two-shot 8.9 us at
# 256 KiB (32 x 4096), two-shot 10.3 vs 10.7 at 1 MiB, 19.6 vs 22.5 at 4 MiB, 32.1 vs 35.6 at 8 MiB;
# world 4 (allreduce_fusion_rows_h200_x4.md) one-shot 8.4 vs 8.9 at 64 KiB (8 x 4096), two-shot 9.5
# vs 11.2 at 256 KiB, 13.8 vs 22.2 at 1 MiB. The table before (8 MiB / 1 MiB, from before the wide
# and rounds two-shot forms, the lamport crossover at 4 ranks since lowered to 512 KiB) sent
# (lamport's crossover, 8 MiB] at 2 ranks and (512 KiB, 1 MiB] at 4 to one-shot: 128 x 4096 at 4
# ranks ran 22.2 us where two-shot takes 13.8. World 8: NOT measured, world 4's.
ONESHOT_CROSSOVER_BYTES = {2: 512 << 10, 4: 128 << 10, 8: 128 << 10}


def _by_world(table: Mapping[int, int], world: int) -> int:
    return table.get(world, table[8])


def _default_rows_per_cta() -> dict:
    # One row per CTA spreads small-M lamport / one-shot calls over twice the SMs at H=4096: fused
    # fp8 lamport on 2 x H200, M=8 / 32 / 128 x 4096: 4.15 / 4.81 / 7.18 us vs 4.66 / 5.20 / 8.02
    # with two rows per CTA, equal elsewhere (benchmarks/results/allreduce_fusion_h200_x2.md,
    # --tuning runs). 0 = by size (SIZED_ROWS_PER_CTA), else choose_tiling's
    # (kernels/compile_allreduce.py).
    return {"lamport": 1, "oneshot": 1, "twoshot": 0}


# NOTE [sized rows per CTA]: where Tuning.rows_per_cta leaves an algorithm at 0, its rows per CTA
# by world size and bytes of one launch, a ladder as in NOTE [sized forms] (0: choose_tiling's,
# which gives more than one row per CTA only for rows of at most 4096 bf16 elements). World 4,
# two-shot at H = 4096, fused FP8 (benchmarks/results/wide_rows_h200_x4.md; @w2 = choose_tiling's
# two rows): one row per CTA below 2 MiB (push-wide: 64 / 128 / 192 rows 10.8 / 13.6 / 16.8 us
# against 11.7 / 14.3 / 17.1), two from 2 MiB (256 / 384 / 512 rows 20.1 / 26.2 / 30.6 against
# 20.6 / 26.4 / 31.3), one again at 16 MiB (pull: 2048 rows 96.1 against 98.2; 105.7 against
# 107.3 in twoshot_rows_h200_x4.md, before two-shot lost its third barrier), choose_tiling's from
# 32 MiB (one row per CTA not measured there; nor rows of 2048 elements, four rows per CTA by
# choose_tiling). World 8: world 4's rule, NOT measured.
_WORLD4_ROWS = ((0, 1), (2 << 20, 0), (16 << 20, 1), (32 << 20, 0))
SIZED_ROWS_PER_CTA = {"twoshot": {2: ((0, 0),), 4: _WORLD4_ROWS, 8: _WORLD4_ROWS}}


# Who moves the rows of a two-shot call over NVLink (NOTE [two-shot forms] in kernels/twoshot.py):
# "push" (remote stores in both exchanges), "pull-gather" (stores, then loads), "pull" (loads in
# both, after a local copy of x); "push-wide" / "pull-wide": the same traffic from a grid world
# times as wide, a CTA per (slice, row group) (NOTE [wide two-shot]); "push-rounds" / "pull-rounds":
# a CTA's rows in rounds, the next round's crossing the link while this one is finished (NOTE
# [two-shot rounds]). Tuning's default "auto" picks by world size and bytes
# (SIZED_FORMS).
TWOSHOT_FORMS = ("push", "pull-gather", "pull", "push-wide", "pull-wide", "push-rounds",
                 "pull-rounds")
# How a lamport reader polls (NOTE [lamport polls] in kernels/lamport.py): "poll-all" re-reads every
# slot each pass, "poll-unseen" only the vectors not yet arrived. "poll-all" is what the tables
# above measured; "poll-unseen" is to be measured.
LAMPORT_FORMS = ("poll-all", "poll-unseen")
# How the sequence-parallel reduce-scatter overlaps its epilogue with its pushes (NOTE [reduce-scatter
# rounds] in kernels/reducescatter.py): "serial" (push everything, one barrier, then the epilogue) or
# "pipelined" (up to 4 rounds of pushes and barriers per CTA, the epilogue of one round while the
# next crosses the link), "pipelined-8", "-16" or "-32" (up to 8, 16 or 32 rounds), "pipelined-2"
# (up to 2), "pipelined-g2" / "-g4" (rounds of at most 2 / 4 row groups, however many),
# "pipelined-tma" (pipelined-g2's rounds, or of one row group where a shared-memory stage holds only
# one, the x pushes issued as TMA bulk copies: NOTE [bulk-copy pushes]; in no ladder, not measured
# yet), "roles-tma" (pusher CTAs that push x by TMA bulk copies and finisher CTAs that finish row
# groups as they land, flags and counts instead of barriers: NOTE [reduce-scatter roles by TMA] in
# kernels/rolespush.py; in no ladder, not run on a GPU yet); new forms go last, so that the earlier
# ones keep their descriptor codes. Tuning's default "auto" picks by size (SIZED_FORMS).
REDUCESCATTER_FORMS = ("serial", "pipelined", "pipelined-8", "pipelined-16", "pipelined-32",
                       "pipelined-2", "pipelined-g2", "pipelined-g4", "pipelined-tma", "roles-tma")
# How the row gather (kernels/rowgather.py) keeps bytes in flight (NOTE [row gather batches]):
# "unit" (one 16-byte unit per thread at a time) or "batched" (several loads first, then their
# stores). Tuning's default "auto" picks by size (SIZED_FORMS).
ROWGATHER_FORMS = ("unit", "batched")
# Each algorithm's kernel forms (a compile-time choice that keeps the bits), the call descriptor's
# form 0 first; Tuning holds algorithm A's as the field `A_form`, read from DISTNORM_<A>_FORM.
ALGORITHM_FORMS = {"twoshot": TWOSHOT_FORMS, "lamport": LAMPORT_FORMS,
                   "reducescatter": REDUCESCATTER_FORMS, "rowgather": ROWGATHER_FORMS}
# NOTE [sized forms]: Tuning's "auto" (the default) for these algorithms takes, per world size
# (key 0: any), a ladder ((from_bytes, form), ...): the form of the last rung whose from_bytes the
# call's bytes reach (reduce-scatter: M x H x element size of x; row gather: the bytes gathered,
# every rank's rows of every tensor; two-shot: one launch's M x H x element size of x). Measured
# on 2 and 4 H200s (benchmarks/results/seqpar_forms_h200_x2.md, seqpar_h200_x4.md): the pipelined
# reduce-scatter wins from 2048 x 8192 bf16 (32 MiB: 73.0 -> 69.7 us at 2 ranks) to 16384 x 8192
# (521 -> 483; 4 ranks 696 -> 635) and loses at 2048 x 4096 (16 MiB: 38.0 -> 42.1 at 2 ranks,
# 58.8 -> 64.4 at 4); the batched gather wins from 8 MiB gathered (2048 x 4096 FP8: 61.1 -> 60.4 us
# with the serial reduce-scatter at 2 ranks; 16384 x 8192 784 -> 746) and loses 1.7% at 2 MiB (512
# x 4096 FP8, 4 ranks); the rule itself, 2 ranks: within 2% of the best forced pair at every size
# (seqpar_sized_h200_x2.md). Every rank computes the same form from the same call, so they agree.
#
# Two-shot, by world size. World 2: "push" below 64 MiB (the pull and wide forms never won there),
# "push-rounds" from 64 MiB (benchmarks/results/twoshot_forms_h200_x2.md, fused FP8: 8192 x 4096
# 218.5 -> 206.3 us, 8192 x 8192 428.7 -> 395.6, 16384 x 8192 860.1 -> 797.1; it lost at 2048 x
# 8192, 109.7 vs 111.8, and at 2048 x 4096, 58.0 vs 64.5). World 4
# (benchmarks/results/tuning_forms_h200_x4.md, allreduce_small_h200_x4.md, branches_ab_h200_x4.md;
# fused FP8 / plain, three-barrier two-shot): "pull" from 512 KiB to 32 MiB (128 x 4096 FP8 19.3 ->
# 19.0 us, 128 x 8192 25.6 -> 24.2, 512 x 4096 39.0 -> 36.2, 512 x 8192 64.4 -> 58.1), "push" below
# (1 x 4096 FP8 11.5 vs 12.2 pulled, 8 x 8192 14.2 vs 14.6) and from 32 MiB (8192 x 8192 653.5 vs
# 680.1). Since the wide and rounds forms (benchmarks/results/twoshot_forms_h200_x4.md, two
# barriers, fused FP8): "push-wide" below 16 MiB (128 x 4096 16.5 -> 14.2 us, 128 x 8192 22.3 ->
# 20.0, 512 x 4096 33.5 -> 30.7, 512 x 8192 55.7 -> 52.5), "pull" at 16 MiB (2048 x 4096 97.8 vs
# 99.6 wide), "push" at 32 MiB (2048 x 8192 183.1 vs 189.8 pull-rounds), "push-rounds" from 64 MiB
# (8192 x 4096 343.0 vs 343.9: a tie; 8192 x 8192 646.4 vs 672.4, 16384 x 8192 1243.4 vs 1328.4).
# World 8: NOT measured, world 4's rule.
#
# The reduce-scatter that gathers q in its epilogue ("rsgather", NOTE [gather in the epilogue]) has
# its own ladder, for 1-byte codes "serial" at every size until the copy-out by rounds (below):
# there the pipelined rounds only added waits (2 x H200, gathered FP8: 2048 x 8192 85.5 us serial
# vs 90.9 pipelined, 2048 x 4096 46.5 vs 53.4, 16384 x 8192 649.3 vs 655.7). Packed FP4 took the reduce-scatter's ladder, whose pipelined
# rounds overlapped its heavier epilogue (gathered NVFP4 8192 x 8192 348.3 serial vs 333.1 pipelined,
# 16384 x 8192 675.6 vs 646.0; 2048 x 4096 62.3 vs 66.4; benchmarks/results/seqpar_h200_x2.md,
# 2026-11-27, sixth session, and seqpar_rsgather_h200_x2.md). Since the scales go with q, packed
# FP4 has a ladder of its own, by world size: gathered NVFP4 at 2 ranks (seqpar_rounds_h200_x2.md)
# ties at 32 MiB (2048 x 8192: 88.2 serial, 88.3 pipelined) and is pipelined faster from 64 MiB
# (8192 x 4096 162.1 vs 168.1, 16384 x 8192 608.5 vs 635.1); at 4 ranks (seqpar_merged_h200_x4.md) serial is faster up to 128
# MiB (2048 x 8192 122.8 vs 137.0, 8192 x 4096 216.2 vs 233.4, 16384 x 4096 420.4 vs 429.5; 8192 x
# 8192 433.7 vs 429.6) and pipelined from 256 MiB (16384 x 8192 826.3 vs 836.7); 8 ranks: 4's.
# Since the pipelined form copies each round out after its barrier (NOTE [copy-out by rounds] in
# kernels/reducescatter.py; benchmarks/results/copy_rounds_ab_h200_x2.md, 2 x H200), 1-byte codes
# at 2 ranks go pipelined from 64 MiB too (gathered FP8 8192 x 4096 158.7 vs 159.0 serial: a tie;
# 8192 x 8192 303.8 vs 313.5, 16384 x 4096 303.0 vs 313.7, 16384 x 8192 602.0 vs 622.3) and stay
# serial below (2048 x 8192 83.0 vs 87.1, 2048 x 4096 46.0 vs 51.8). Re-measured with it at 4 ranks
# (benchmarks/results/seqpar_table_h200_x4.md, rs_rounds8_ab_h200_x4.md, 2026-11-28): pipelined is
# faster from 128 MiB for 1-byte codes (8192 x 8192 463.7 vs 476.4 us, 16384 x 4096 464.3 vs 482.8,
# 16384 x 8192 899.8 vs 938.5; 8192 x 4096 a tie, 249.2 vs 250.2) and for packed FP4 (8192 x 8192
# 420.9 vs 433.7; 16384 x 4096 a tie, 421.3 vs 420.2), serial below (NVFP4 8192 x 4096 215.7 vs
# 230.3), except packed FP4 at 8 MiB (512 x 8192: 45.8 pipelined vs 47.4 serial, and 45.7 vs 46.3
# in seqpar_merged_h200_x4.md; 16 MiB is serial's again, 2048 x 4096 68.3 vs 78.0); so both go
# pipelined from 128 MiB at 4 ranks, packed FP4 at 8 MiB too (8 ranks: 4's). "pipelined-8" (8 rounds,
# rs_rounds8_ab_h200_x2.md, 2 ranks against 4 rounds): packed FP4 3.1-4.7 % faster from 64 MiB
# (8192 x 4096 158.5 -> 153.5, 8192 x 8192 302.8 -> 290.9, 16384 x 8192 598.3 -> 570.0), 1-byte
# codes 0.8-2.3 % faster from 128 MiB (8192 x 8192 303.5 -> 300.9, 16384 x 8192 601.5 -> 587.5) and
# 2.5 % slower at 64 MiB (8192 x 4096 158.0 -> 161.9); at 4 ranks slower everywhere (1.8-11 %).
# "pipelined-16" and "-32" (2 x H200, every form forced side by side, two runs each:
# seqpar_pipe16_h200_x2.md, seqpar_pipe32_h200_x2.md, seqpar_pipe32b_h200_x2.md): packed FP4 is
# fastest at about two row groups per round, so 16 rounds from 128 MiB (8192 x 8192 284.2-284.9 us
# against pipelined-8's 290.9-291.2) and 32 from 256 MiB (16384 x 8192 547.1-547.6 against 553.1-
# 553.5); 1-byte codes at about four (pipelined-8 stays). A round of a single row group is a cliff
# (8192 x 4096 with 16 rounds: 177.3 against 153.9; 32 rounds at 128 MiB: 346.4 against 284.2).
# Under the kernel-swizzled scales (Tuning.gather_by "epilogue-swizzled", the default), every form
# forced at 2 ranks (benchmarks/results/seqpar_forms_swz_h200_x2.md, 2026-11-28): packed FP4 at 16
# MiB is fastest in rounds of at most four row groups (2048 x 4096: "pipelined-g4" 44.3 us against
# serial's 47.0, g2 45.4) and at 32 MiB of two (2048 x 8192: "pipelined-g2" 81.2 against 83.3),
# hence those two rungs; the larger rungs stay (g2 within 0.5 % of them there), 1-byte codes keep
# theirs (every form within 0.4 us of serial at 16 and 32 MiB).
# sized_ladder picks the ladder.
_TWOSHOT_WORLD4 = ((0, "push-wide"), (16 << 20, "pull"), (32 << 20, "push"),
                   (64 << 20, "push-rounds"))
SIZED_FORMS = {"reducescatter": {0: ((0, "serial"), (32 << 20, "pipelined"))},
               "rsgather": {2: ((0, "serial"), (64 << 20, "pipelined"),
                                (128 << 20, "pipelined-8")),
                            4: ((0, "serial"), (128 << 20, "pipelined"))},
               "rsgather_fp4": {2: ((0, "serial"), (16 << 20, "pipelined-g4"),
                                    (32 << 20, "pipelined-g2"), (64 << 20, "pipelined-8"),
                                    (128 << 20, "pipelined-16"), (256 << 20, "pipelined-32")),
                                4: ((0, "serial"), (8 << 20, "pipelined"), (16 << 20, "serial"),
                                    (128 << 20, "pipelined"))},
               "rowgather": {0: ((0, "unit"), (8 << 20, "batched"))},
               "twoshot": {2: ((0, "push"), (64 << 20, "push-rounds")),
                           4: _TWOSHOT_WORLD4, 8: _TWOSHOT_WORLD4}}


def sized_ladder(algo: str, packed_fp4: bool = False) -> str:
    """The SIZED_FORMS entry `algo`'s "auto" form reads (NOTE [sized forms]): its own, else its
    knob's; rsgather's for 1-byte codes, "rsgather_fp4" for packed FP4."""
    if algo == "rsgather" and packed_fp4:
        return "rsgather_fp4"
    if algo in SIZED_FORMS:
        return algo
    return knob(algo)


def sized_form(algo: str, nbytes: int, world: int) -> str:
    """NOTE [sized forms]: the form of `algo` for a launch of `nbytes` on `world` ranks (a world
    size without an entry takes the next larger one's, then the largest's; key 0: any world)."""
    return _rung(SIZED_FORMS[algo], nbytes, world)


def _rung(table: Mapping[int, tuple], nbytes: int, world: int):
    """The value of the last rung of table's ladder for `world` (NOTE [sized forms]) whose
    from_bytes `nbytes` reaches."""
    key = 0 if 0 in table else min((w for w in table if w >= world), default=max(table))
    return [value for from_bytes, value in table[key] if nbytes >= from_bytes][-1]


# NOTE [world CTA caps]: the most CTAs of one launch by world size where fewer than every
# co-resident CTA measured faster (Tuning.max_ctas, when it names the algorithm, wins). World 4,
# lamport capped at 64 (two rows per CTA from 128 rows): 128 x 4096 FP8 17.5 -> 16.3 us, bf16 norm
# 17.6 -> 15.9, plain 17.1 -> 15.4 (benchmarks/results/allreduce_small_h200_x4.md); a cap of 32
# was slower (18.8, tuning_forms_h200_x4.md); with the spare checker FP8 128 x 4096 17.6 -> 16.1
# (branches_ab_h200_x4.md; slower from 512 rows, where auto runs two-shot). Worlds 2 and 8: not
# measured, no cap.
WORLD_MAX_CTAS = {4: {"lamport": 64}}
AUTO_FORM = "auto"
# What Tuning's `A_form` accepts, its default first
TUNING_FORMS = {algo: ((AUTO_FORM,) + forms if algo in SIZED_FORMS else forms)
                for algo, forms in ALGORITHM_FORMS.items()}
# Who gathers the sequence-parallel ops' rows when the workspace has peer mappings (Tuning.gather_by),
# the default first: "epilogue-swizzled" ("epilogue", and 128x4-swizzled block scales laid out by
# the kernel, NOTE [swizzled scales gathered] in kernels/reducescatter.py, instead of pushed linear
# and laid out after it: on 2 x H200 gathered NVFP4 at 128 x 4096 10.2 us against 12.0, 8192 x 4096
# 147.6 against 152.7, at par or faster at 7 of 8 shapes, 0.6 us slower at 2048 x 4096:
# seqpar_weak_ab_h200_x2.md), "epilogue" (q and linear scale rows pushed from the reduce-scatter's
# epilogue, NOTE [gather in the epilogue], the rest as "peers"), "peers" (the row gather kernel),
# "nccl". The peers beat NCCL's all_gather at every size measured on 2 x H200 (FP8 at 512 x 8192
# 35.4 vs 46.5 us, 16384 x 8192 796 vs 806: seqpar_h200_x2.md).
# the modes in which the reduce-scatter kernel gathers q in its epilogue (when it fits)
GATHERS_IN_EPILOGUE = ("epilogue-swizzled", "epilogue")
GATHER_BY = GATHERS_IN_EPILOGUE + ("peers", "nccl")
# DISTNORM_NOPEER_FORM (collectives/nopeer.py, NOTE [no-peer forms]): "auto" (by byte count, the
# default) or a forced form
NOPEER_FORMS = ("auto", "gather", "split", "split-h")


@dataclass(frozen=True)
class Tuning:
    """Launch settings that do not change results (benchmarks A/B them). Every rank of a
    workspace must use the same ones: a form differing between ranks raises CommMismatchError (it is
    in the call descriptor), and so does a grid differing under the barrier algorithms (rows_per_cta,
    max_ctas, or a GPU with another SM count: the grid size is in the barrier signature).

    pdl: programmatic dependent launch (NOTE [programmatic dependent launch] in kernels/allreduce.py).
    rows_per_cta: {algo: rows per CTA}, 0 = by size (NOTE [sized rows per CTA]), else
      choose_tiling's.
    max_ctas: {algo: most CTAs of one launch}, 0 = as many as are co-resident (the barrier
      kernels' limit, always kept), absent = the world size's cap (NOTE [world CTA caps]); a
      run-time argument, so no recompile.
    twoshot_form: "auto" (NOTE [sized forms]: by world size and bytes) or one of TWOSHOT_FORMS
      (the two-shot kernel's traffic; same bits).
    lamport_form: one of LAMPORT_FORMS (how a lamport reader polls; same bits).
    reducescatter_form: "auto" (NOTE [sized forms]) or one of REDUCESCATTER_FORMS (the
      sequence-parallel reduce-scatter's overlap of epilogue and pushes; same bits).
    rowgather_form: "auto" or one of ROWGATHER_FORMS (the row gather's bytes in flight; same bytes).
    timeout_s: how long a CTA waits for a peer before it records a timeout and gives up.
    host_timeout_s: how long a host-side wait for the group (the first lamport call's preparation,
      reset) lasts before it raises: long, because ranks reach their first call at different times
      (model loading, compilation).
    gather_by: how the sequence-parallel ops gather rows with peer mappings: "epilogue-swizzled"
      (the default: "epilogue" with swizzled scales stored swizzled by the kernel, GATHER_BY's
      note), "epilogue" (q from the reduce-scatter kernel's epilogue when it fits, NOTE [gather in
      the epilogue]; the rest as "peers"), "peers" (the row gather kernel, kernels/rowgather.py)
      or "nccl" (torch.distributed all_gather); same bytes.
    """

    pdl: bool = True
    rows_per_cta: Mapping[str, int] = field(default_factory=_default_rows_per_cta)
    timeout_s: float = 10.0
    host_timeout_s: float = 120.0
    twoshot_form: str = TUNING_FORMS["twoshot"][0]
    lamport_form: str = LAMPORT_FORMS[0]
    reducescatter_form: str = TUNING_FORMS["reducescatter"][0]
    rowgather_form: str = TUNING_FORMS["rowgather"][0]
    max_ctas: Mapping[str, int] = field(default_factory=dict)
    gather_by: str = GATHER_BY[0]

    def __post_init__(self) -> None:
        if self.gather_by not in GATHER_BY:
            raise ValueError(f"gather_by must be one of {GATHER_BY}, got {self.gather_by!r}")
        for algo, forms in TUNING_FORMS.items():
            name = f"{algo}_form"
            if getattr(self, name) not in forms:
                raise ValueError(f"{name} must be one of {forms}, got {getattr(self, name)!r}")
        for name in ("timeout_s", "host_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 s, got {getattr(self, name)!r}")

    def ctas(self, algo: str, co_resident: int, world: int = 0) -> int:
        """CTAs of one `algo` launch on `world` ranks: at most `co_resident`, at most
        max_ctas[algo] when set, else at most the world's cap (NOTE [world CTA caps])."""
        algo = knob(algo)
        if algo in self.max_ctas:
            cap = self.max_ctas[algo]
        else:
            cap = WORLD_MAX_CTAS.get(world, {}).get(algo, 0)
        return min(cap, co_resident) if cap > 0 else co_resident

    def form(self, algo: str, nbytes: int = 0, world: int = 2, ladder: str = "") -> str:
        """The form of `algo`'s kernel (ALGORITHM_FORMS) for a launch of `nbytes` on `world` ranks
        (NOTE [sized forms]: what "auto" goes by); "" for an algorithm with one form. ladder: the
        SIZED_FORMS entry "auto" reads (default: algo's own if it has one, else its knob's)."""
        ladder = ladder or sized_ladder(algo)
        algo = knob(algo)
        if algo not in ALGORITHM_FORMS:
            return ""
        form = getattr(self, f"{algo}_form")
        return sized_form(ladder, nbytes, world) if form == AUTO_FORM else form

    def rows(self, algo: str, nbytes: int = 0, world: int = 2) -> int:
        """Rows per CTA of `algo`'s kernel for a launch of `nbytes` on `world` ranks: rows_per_cta's
        when set, else NOTE [sized rows per CTA]; 0 = choose_tiling's."""
        algo = knob(algo)
        rows = self.rows_per_cta.get(algo, 0)
        if rows == 0 and algo in SIZED_ROWS_PER_CTA:
            return _rung(SIZED_ROWS_PER_CTA[algo], nbytes, world)
        return rows

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    @classmethod
    def from_env(cls) -> "Tuning":
        """The defaults, overridden by DISTNORM_PDL=0 (no programmatic dependent launch),
        DISTNORM_BARRIER_TIMEOUT_S and DISTNORM_HOST_TIMEOUT_S (seconds), DISTNORM_TWOSHOT_FORM
        ("auto" or one of TWOSHOT_FORMS), DISTNORM_LAMPORT_FORM (one of LAMPORT_FORMS),
        DISTNORM_REDUCESCATTER_FORM ("auto" or one of REDUCESCATTER_FORMS),
        DISTNORM_ROWGATHER_FORM ("auto" or one of ROWGATHER_FORMS) and DISTNORM_GATHER_BY (one of
        GATHER_BY)."""
        return cls(pdl=pdl_from_env(), gather_by=_form("DISTNORM_GATHER_BY", GATHER_BY),
                   timeout_s=_seconds("DISTNORM_BARRIER_TIMEOUT_S", cls.timeout_s),
                   host_timeout_s=_seconds("DISTNORM_HOST_TIMEOUT_S", cls.host_timeout_s),
                   **{f"{algo}_form": _form(f"DISTNORM_{algo.upper()}_FORM", forms)
                      for algo, forms in TUNING_FORMS.items()})


def settings_ranks_share() -> dict[str, str]:
    """The environment settings every rank of a workspace must share, as this process resolves
    them (unset: the default): each chooses which collectives or kernels a call runs, and ranks on
    different ones would wait for each other until a timeout (NCCL's can be minutes) or read rows
    never written. comm.Workspace compares them across the group when it is built."""
    return {"DISTNORM_GATHER_BY": os.environ.get("DISTNORM_GATHER_BY", GATHER_BY[0]),
            "DISTNORM_NOPEER_FORM": os.environ.get("DISTNORM_NOPEER_FORM", NOPEER_FORMS[0]),
            **{f"DISTNORM_{algo.upper()}_FORM": os.environ.get(f"DISTNORM_{algo.upper()}_FORM",
                                                               forms[0])
               for algo, forms in TUNING_FORMS.items()}}


def check_shared_settings(boot) -> None:
    """Collective over `boot` (a comm.Bootstrap): ValueError on every rank when the ranks resolve
    a setting of settings_ranks_share to different values, naming each rank's. Registered as a
    Workspace open check (collectives/__init__.py): it runs when a workspace is built, rather than
    surfacing as a timeout in a later call."""
    every = boot.all_gather_object(settings_ranks_share())
    differ = [k for k in every[0] if len({e.get(k) for e in every}) > 1]
    if differ:
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {r} {e.get(k)!r}" for r, e in enumerate(every))
                           for k in differ)
        raise ValueError(f"distnorm.comm.Workspace: the ranks set {', '.join(differ)} differently "
                         f"({detail}); set them alike on every rank (they choose the collectives "
                         "and kernels each call runs)")


def pdl_from_env() -> bool:
    """Programmatic dependent launch for every kernel (all-reduce and single-GPU) unless
    DISTNORM_PDL=0."""
    return os.environ.get("DISTNORM_PDL", "1") != "0"


def _form(name: str, forms: tuple) -> str:
    """The form environment variable `name` chooses (the default, forms[0], when unset)."""
    value = os.environ.get(name, forms[0])
    if value not in forms:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(forms)}")
    return value


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


def lamport_capacity(world: int, hidden: int, elem_size: int, buffer_bytes: int) -> int:
    """Most rows one lamport launch may take: world * rows * H * elem_size <= one area (exact)."""
    return _slot_rows(world, hidden * elem_size, lamport_split(buffer_bytes)[1], False, False)


def check_algo(algo) -> None:
    """ValueError naming `algo` unless it is one the all-reduce ops take (ALGOS)."""
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")


def choose_algo(algo: str, world: int, m: int, hidden: int, elem_size: int,
                buffer_bytes: Optional[int] = None, plain: bool = False) -> str:
    """The algorithm for `algo` ("auto" picks by bytes per rank; lamport only when, given the
    workspace's buffer_bytes, one lamport launch holds all M rows). plain: a plain all-reduce (no
    residual, norm or quantization output)."""
    check_algo(algo)
    if algo != "auto":
        return algo
    if world <= 1:
        return "oneshot"
    nbytes = m * hidden * elem_size
    lamport_table = LAMPORT_CROSSOVER_BYTES_PLAIN if plain else LAMPORT_CROSSOVER_BYTES
    if nbytes <= _by_world(lamport_table, world) and (
            buffer_bytes is None or m <= lamport_capacity(world, hidden, elem_size, buffer_bytes)):
        return "lamport"
    return "oneshot" if nbytes <= _by_world(ONESHOT_CROSSOVER_BYTES, world) else "twoshot"


def max_chunk_rows(algo: str, world: int, m: int, hidden: int, elem_size: int, buffer_bytes: int,
                   swizzled: bool, gather_acc: bool) -> int:
    """Most rows one launch of `algo` may take without overflowing its part of the data buffer
    (>= 1, else ValueError). buffer_bytes: the workspace's whole data buffer. Swizzled chunks after
    the first start at multiples of 128 rows."""
    general, area = lamport_split(buffer_bytes)
    alg = ALGORITHMS[algo]
    cap = alg.rows(world, hidden * elem_size, area if alg.lamport_part else general, gather_acc,
                   swizzled)
    if swizzled and m > cap:
        cap = cap // SWIZZLE_ROWS * SWIZZLE_ROWS
    if cap < 1:
        raise ValueError(f"workspace buffer of {buffer_bytes} bytes cannot hold one chunk of "
                         f"H={hidden} for {algo} on {world} ranks; create it with a larger buffer_bytes")
    return cap


def plan_launch(algo: str, world: int, m: int, hidden: int, elem_size: int, buffer_bytes: int,
                swizzled: bool, gather_acc: bool, plain: bool) -> tuple[str, int]:
    """(algorithm, rows per launch) for one call of m rows: choose_algo, except that a lamport call
    with swizzled scales that needs chunks but whose area holds fewer than 128 rows runs one-shot,
    and an algorithm distnorm chose (auto, or that one-shot) whose part of the buffer cannot hold
    one chunk runs two-shot, whose chunk holds a slice of every row (ValueError only when the
    caller named the algorithm, or two-shot does not fit either)."""
    chosen = choose_algo(algo, world, m, hidden, elem_size, buffer_bytes, plain)
    if chosen == "lamport" and swizzled and m > 1:
        cap = lamport_capacity(world, hidden, elem_size, buffer_bytes)
        if cap < m and cap < SWIZZLE_ROWS:
            chosen = "oneshot"
    try:
        return chosen, max_chunk_rows(chosen, world, m, hidden, elem_size, buffer_bytes,
                                      swizzled, gather_acc)
    except ValueError:
        if chosen in (algo, "twoshot"):
            raise
    return "twoshot", max_chunk_rows("twoshot", world, m, hidden, elem_size, buffer_bytes,
                                     swizzled, gather_acc)
