"""Row tilings (distnorm/kernels/tiling.py) and the single-GPU cluster choice, on the CPU: every
vector of a row is held by exactly one thread, and a row thread holds the same vectors whatever the
cluster size, so the kernels' sum of squares is the same float32 computation at every M
(NOTE [batch invariance] in kernels/norm_quant.py; the GPU proof is test_batch_invariance)."""
from __future__ import annotations

import pytest

from distnorm.formats import MAX_HIDDEN, MIN_HIDDEN, VEC
from distnorm.kernels.tiling import RowTiling, choose_tiling, cluster_sizes, row_threads_for
from distnorm.formats import make_quant_spec
from distnorm.ops import cluster_for

HIDDEN = sorted({MIN_HIDDEN, 256, 1000, 1536, 2000, 2048, 4096, 5120, 7168, 8192, 12288, 16384,
                 24576, 32768, MAX_HIDDEN} & set(range(MIN_HIDDEN, MAX_HIDDEN + 1, VEC)))


@pytest.mark.parametrize("H", HIDDEN)
def test_every_vector_once_same_threads_for_every_cluster(H):
    canonical = choose_tiling(H, 1)
    assert canonical.row_threads == row_threads_for(H)
    want = [canonical.vectors_of(lane) for lane in range(canonical.row_threads)]
    assert sorted(v for vs in want for v in vs) == list(range(H // VEC))
    for n in cluster_sizes(H):
        t = choose_tiling(H, n)
        assert t.row_threads == canonical.row_threads and t.threads_per_row % 32 == 0
        assert t.vecs_per_thread == canonical.vecs_per_thread and t.exact == canonical.exact
        assert [t.vectors_of(lane) for lane in range(t.row_threads)] == want
        assert t.threads <= 512


@pytest.mark.parametrize("H", HIDDEN)
def test_cluster_choice_is_a_legal_size(H):
    for spec in (None, make_quant_spec("fp8_per_token"), make_quant_spec("nvfp4")):
        for M in (1, 7, 48, 49, 64, 65, 128, 4099):
            n = cluster_for(H, M, spec)
            assert n in cluster_sizes(H)
            choose_tiling(H, n)


def test_cluster_choice_follows_the_measurements():
    """The rule of cluster_for (docstring; benchmarks/results/cluster_ab_h200.md)."""
    nvfp4, fp8 = make_quant_spec("nvfp4"), make_quant_spec("fp8")
    assert [cluster_for(8192, M, s) for M in (1, 64) for s in (None, fp8, nvfp4)] == [1] * 6
    assert [cluster_for(16384, M, fp8) for M in (1, 48, 49, 64, 65)] == [4, 4, 1, 1, 1]
    assert [cluster_for(16384, M, nvfp4) for M in (1, 48, 49, 64, 65)] == [4, 4, 2, 2, 1]
    assert [cluster_for(32768, M, s) for M in (1, 48, 49, 64, 65) for s in (fp8, nvfp4)] == \
        [4, 4, 4, 4, 2, 2, 2, 2, 1, 1]


def test_clusters_that_do_not_split_into_warps_are_refused():
    with pytest.raises(ValueError, match="whole warps"):
        choose_tiling(4096, 8)  # 128 threads per row: 16 per CTA


def test_split_parts_own_their_columns_and_select_them():
    """NOTE [compact parts] (kernels/split_parts.py), on the CPU where CI runs: part p of a split
    into S owns vectors k * S + p, the selects pick exactly cands[p] for every p, and a column
    past nv (a ragged nv, or a part with no vector) turns the row predicate on."""
    import numpy as np

    from distnorm.kernels.split_parts import SplitParts, select_by_bits

    for s in (1, 2, 4, 8):
        for p in range(s):
            picks = select_by_bits(list(range(s)), p, lambda pick, a, b: a if pick else b)
            assert picks == p, (s, p)

    class Parts(SplitParts):
        def __init__(self, hidden, split):
            self.t, self.split = RowTiling(hidden, row_threads_for(hidden)), split

    for hidden, split in ((32768, 4), (4096, 2), (768, 4), (2880, 2), (4096, 1)):
        parts = Parts(hidden, split)
        nv = parts.t.vecs_per_thread
        owned = []
        for p in range(split):
            run_time_part = np.int32(p) if split > 1 else None  # not a Python int: a run-time value
            cols = parts.part_columns(run_time_part)
            assert [int(j) for j in cols] == list(range(p, -(-nv // split) * split, split))[:len(cols)]
            owned += [int(j) for j in cols if j < nv]
            assert parts._columns_exact(cols) == (parts.t.exact and nv % split == 0)
        assert sorted(owned) == list(range(nv)), (hidden, split)
