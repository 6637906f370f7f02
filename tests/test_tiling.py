"""Row tilings (distnorm/kernels/tiling.py) and the single-GPU cluster choice, on the CPU: every
vector of a row is held by exactly one thread, and a row thread holds the same vectors whatever the
cluster size, so the kernels' sum of squares is the same float32 computation at every M
(NOTE [batch invariance] in kernels/norm_quant.py; the GPU proof is test_batch_invariance)."""
from __future__ import annotations

import pytest

from distnorm.formats import MAX_HIDDEN, MIN_HIDDEN, VEC
from distnorm.kernels.tiling import choose_tiling, cluster_sizes, row_threads_for
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
