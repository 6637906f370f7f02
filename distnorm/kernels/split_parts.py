"""Split rows' parts in the norm-quant cores (a mixin of NormQuantCore, kernels/norm_quant.py).

A decode row may be split over `split` CTAs (NOTE [split rows] in kernels/fused_norm.py), part p
storing the vectors j % split == p: which vectors a part owns, and the compact fragment of them it
computes y and the quantized bytes from (NOTE [compact parts]). Uses the core's `t` (RowTiling) and
`split`.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from distnorm.formats import VEC  # absolute imports: see compat.py
from distnorm.kernels import ptx


class SplitParts:
    """A split part's vector columns and compact fragment; mixed into NormQuantCore."""

    def _mine(self, j, part):
        """Whether vector j is stored by part `part` (NOTE [split rows]): a Python True, folded
        away, without a split or for a run-time column of part_columns (the part's own)."""
        if part is None or self.split == 1 or not isinstance(j, int):
            return True
        return part == j % self.split

    # NOTE [compact parts]
    # A split part (NOTE [split rows] in fused_norm.py) stores the vectors j % split == part, a
    # run-time value. Guarding each vector's y and quantizer code by that test kept all nv copies
    # in the kernel, each behind a branch, of which a part runs nv / split. After the sum of squares
    # (which needs every vector) a part now moves its own vectors into a fragment of
    # ceil(nv / split) vectors by selects on the part's bits (compact_part), loads only its own
    # weights, and y and the quantizer run on that: code for nv / split vectors, no branches.
    # Column k of the compact fragment is vector j = k * split + part (part_columns); past nv (a
    # ragged nv) it holds any value and is never stored. Per-token scales need every y for the
    # row amax: their y is made for every vector and compacted after the amax. (Stores behind a
    # branch per vector were miscompiled: per-token FP8 at H = 2880, 2 parts, bf16, CuTe DSL 4.3.5
    # and 4.8.1 stored vector 1's y in vector 2's place, the two parts' stores merged into one
    # with only the address selected by part; the same for static FP8 before it was compacted.
    # Only the residual row, stored in the fused kernel before the epilogue, still goes by part:
    # rejected_single_gpu_ab_h200.md section 12.) SASS instructions (sm_90a; registers): NVFP4 at
    # H = 4096, 4 parts 1152 -> 736 (64 -> 50), per-group FP8 at H = 32768, cluster 4, 4 parts
    # 1480 -> 840 (116 -> 91). Measured on H200 (benchmarks/results/compact_parts_ab_h200.md, M = 1-48): split
    # calls up to 13% faster (MXFP4 1 x 32768 2.23 -> 1.93 us, per-group FP8 2.28 -> 2.00), NVFP4
    # at 1 x 32768 +2.7%. Kernels without a split are unchanged (the same PTX).
    def part_columns(self, part) -> list:
        """The vector columns j this thread makes y and q of, in order: all nv (Python ints)
        without a split, else k * split + part (run-time) for k < ceil(nv / split)."""
        nv = self.t.vecs_per_thread
        if part is None or self.split == 1:
            return list(range(nv))
        return [k * self.split + part for k in range(-(-nv // self.split))]

    def _columns_exact(self, cols: list) -> bool:
        """Whether every column of `cols` is a vector inside the row (no predicate needed)."""
        if all(isinstance(j, int) for j in cols):
            return self.t.exact
        return self.t.exact and len(cols) * self.split == self.t.vecs_per_thread

    def compact_part(self, frag, part):
        """frag (float32, this thread's nv vectors) -> a float32 fragment of part_columns(part)'s
        vectors (NOTE [compact parts]); frag itself without a split."""
        nv = self.t.vecs_per_thread
        if part is None or self.split == 1:
            return frag
        s = self.split
        cols = -(-nv // s)
        out = cute.make_rmem_tensor(cute.make_layout(cols * VEC), Float32)
        for k in range(cols):
            for e in range(VEC):
                cands = [frag[min(k * s + p, nv - 1) * VEC + e] for p in range(s)]
                out[k * VEC + e] = select_by_bits(cands, part, ptx.select_f32)
        return out


def select_by_bits(cands: list, part, select):
    """cands[part] for a run-time part in [0, len(cands)) (a power of two): len - 1 selects
    narrowing on part's bits from the lowest up (depth log2 len). select(pick, a, b): a where the
    int pick is nonzero, else b (ptx.select_f32 in a kernel)."""
    bit = 1
    while len(cands) > 1:
        cands = [select(part & bit, cands[i + 1], cands[i]) for i in range(0, len(cands), 2)]
        bit *= 2
    return cands[0]
