"""How threads cover rows: the compile-time row tiling of every fused kernel. Pure Python (no
torch, no CuTe), so the host picks cluster sizes without importing the DSL.

See NOTE [batch invariance] in kernels/norm_quant.py for why a row's threads depend on H only.
"""
from __future__ import annotations

from dataclasses import dataclass

from distnorm.formats import VEC

__all__ = ["MAX_THREADS", "RowTiling", "row_threads_for", "cluster_sizes", "choose_tiling"]

MAX_THREADS = 512  # 1024-thread CTAs cap registers at 64 and spill; long rows use a cluster instead


@dataclass(frozen=True)
class RowTiling:
    """How threads cover rows (compile-time).

    A row is covered by `row_threads` threads (its canonical thread count, the same for every
    cluster size: NOTE [batch invariance]); with a cluster, CTA c of the cluster hosts the row's
    threads c * threads_per_row ... (c + 1) * threads_per_row - 1. Row thread `lane` holds the
    8-element vectors lane + j * row_threads, j < vecs_per_thread.
    """

    hidden: int
    threads_per_row: int  # per CTA
    rows_per_cta: int = 1
    cluster_n: int = 1

    @property
    def vecs(self) -> int:
        return self.hidden // VEC

    @property
    def row_threads(self) -> int:
        return self.threads_per_row * self.cluster_n

    @property
    def vecs_per_thread(self) -> int:
        return -(-self.vecs // self.row_threads)

    @property
    def exact(self) -> bool:
        """Every thread's every vector is inside the row (no predicate needed)."""
        return self.vecs % self.row_threads == 0

    @property
    def threads(self) -> int:
        return self.threads_per_row * self.rows_per_cta

    @property
    def warps_per_row(self) -> int:
        """Warps of one row in one CTA."""
        return self.threads_per_row // 32

    @property
    def row_warps(self) -> int:
        """Warps of one row over the whole cluster."""
        return self.row_threads // 32

    def vectors_of(self, lane: int) -> list[int]:
        """The vectors row thread `lane` (0 <= lane < row_threads) holds, in its order."""
        return [v for v in range(lane, lane + self.vecs_per_thread * self.row_threads,
                                 self.row_threads) if v < self.vecs]


def row_threads_for(hidden: int) -> int:
    """The canonical threads of a row of `hidden` elements: about 4 vectors (32 elements) each.

    Around 4 independent 16-byte loads per input in flight per thread is what keeps HBM busy without
    spilling; fewer vectors per thread means more threads and more reduction steps.
    """
    vecs = hidden // VEC
    for nv in (4, 2, 3, 5, 6, 8, 1, 7, 10, 12, 16):
        if vecs % nv == 0 and (vecs // nv) % 32 == 0 and vecs // nv <= MAX_THREADS:
            return vecs // nv
    return min(MAX_THREADS, max(32, -(-(-(-vecs // 4)) // 32) * 32))  # ragged: predicated tail


def cluster_sizes(hidden: int) -> list[int]:
    """Cluster sizes a row of `hidden` elements can be split over: each CTA a whole number of warps
    of the canonical threads, at most the portable 8."""
    t = row_threads_for(hidden)
    return [n for n in range(1, 9) if t % (32 * n) == 0]


def choose_tiling(hidden: int, cluster_n: int = 1, block: int = 0,
                  cta_threads: int = 256) -> RowTiling:
    """The row's canonical threads (row_threads_for), split over `cluster_n` CTAs, as many rows
    per CTA as fit in about `cta_threads` threads (at most 8)."""
    if hidden % VEC:
        raise ValueError(f"hidden={hidden} is not a multiple of {VEC}")
    if block and hidden % block:
        raise ValueError(f"hidden={hidden} is not a multiple of the block {block}")
    if cluster_n not in cluster_sizes(hidden):
        raise ValueError(f"hidden={hidden} ({row_threads_for(hidden)} threads per row) does not "
                         f"split into {cluster_n} CTAs of whole warps; sizes: {cluster_sizes(hidden)}")
    per_cta = row_threads_for(hidden) // cluster_n
    rows = max(1, min(8, cta_threads // per_cta))
    return RowTiling(hidden=hidden, threads_per_row=per_cta, rows_per_cta=rows, cluster_n=cluster_n)


# the single-GPU kernel's CTAs (NOTE [padding CTAs] in kernels/fused_norm.py for the padding ones)
FUSED_CTA_THREADS = 128
PAD_CTAS = 8
MIN_PAD_WORDS = 4


def fused_tiling(hidden: int, cluster_n: int, group_size: int) -> RowTiling:
    """The single-GPU kernel's tiling: ~128-thread CTAs (one row up to H = 4096 is 128 threads):
    more, smaller CTAs than 256 spread a few hundred to a few thousand rows more evenly over the
    SMs (H200: NVFP4 at 128 x 4096 4.70 -> 4.08 us, 4096 x 1536 15.3 -> 14.1 us; 16384 rows within
    1%). Not a bit changes."""
    return choose_tiling(hidden, cluster_n, group_size, cta_threads=FUSED_CTA_THREADS)


def pad_words_per_thread(tiling: RowTiling, tile_words: int) -> int:
    """Words each padding CTA thread zeroes of a swizzled tile of `tile_words` words."""
    return max(MIN_PAD_WORDS, -(-tile_words // (PAD_CTAS * tiling.threads)))


def pad_clusters(tiling: RowTiling, tile_words: int) -> int:
    """Clusters (CTAs without one) that zero a partial last tile's padding scales."""
    return -(-tile_words // (pad_words_per_thread(tiling, tile_words) * tiling.threads
                             * tiling.cluster_n))
