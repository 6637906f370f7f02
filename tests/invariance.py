"""Batch-invariance checks: one row's outputs pulled out of a batch, to compare bitwise between
batches of other sizes, algorithms and kernels (NOTE [batch invariance] in kernels/norm_quant.py).

`embed(row, M, pos, gen)` puts a row at position `pos` of M random rows; `row_bytes(out, spec, M, H,
pos)` returns every output of that row as bytes (residual, y, q, its scales in linear order).
"""
from __future__ import annotations

import torch

from distnorm import formats

BATCHES = ((1, 0), (7, 3), (128, 100), (4099, 4000))  # (M, position of the probe row)


def embed(row: torch.Tensor, M: int, pos: int, gen: torch.Generator) -> torch.Tensor:
    """[M, H] of row's dtype: random rows, `row` ([H]) at position pos."""
    out = (torch.randn(M, row.shape[-1], generator=gen, device=row.device) * 2).to(row.dtype)
    out[pos] = row
    return out


def row_bytes(out, spec, M: int, H: int, pos: int, fields=("residual", "y", "q", "scales")) -> dict:
    """{field: uint8 bytes of row `pos`} for the outputs present (static fp8 has no scales)."""
    got = {}
    for name in fields:
        t = getattr(out, name)
        if t is None or (name == "scales" and (spec is None or formats.scales_geometry(spec, M, H) is None)):
            continue
        if name == "scales" and spec.block_scaled and spec.swizzled:
            t = formats.from_swizzled(t, M, H // spec.group_size)
        got[name] = t[pos].contiguous().view(torch.uint8).clone()
    return got


def assert_same_bytes(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: outputs {sorted(got)} vs {sorted(want)}"
    for name, b in want.items():
        diff = (got[name] != b).sum().item()
        assert diff == 0, f"{what}: {name} differs in {diff} of {b.numel()} bytes"
