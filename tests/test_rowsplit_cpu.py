"""The torch.distributed path of the all-reduce ops (distnorm/collectives/rowsplit.py) on the CPU:
gloo ranks and a CPU workspace. For every format and layout, M from 1 to past a chunk, 2 and 3
ranks, outputs are bitwise the reference over the gathered partial sums (poisoned first), and the
row split gives every row to exactly one rank."""
from __future__ import annotations

import pytest
import torch

from distnorm.collectives.rowsplit import slice_bounds
from distnorm.launch import spawn

H = 256


def test_row_split_covers_every_row_once():
    for world in (1, 2, 3, 8):
        for M in (0, 1, 2, 7, 8, 9, 130):
            bounds = [slice_bounds(M, world, r) for r in range(world)]
            rows = [i for a, b in bounds for i in range(a, b)]
            assert rows == list(range(M)), (world, M, bounds)


def _body() -> None:
    import torch.distributed as dist

    import distnorm
    from distnorm import formats
    from distnorm.reference import allreduce_add_rmsnorm_ref
    from quant_check import poison_like, quant_kwargs

    rank, world = dist.get_rank(), dist.get_world_size()
    # 4 KiB of buffer = 8 rows of H=256 bf16 per chunk: M=130 takes 17 chunks
    ws = distnorm.Workspace(dist.group.WORLD, device="cpu", buffer_bytes=4096)
    w = (torch.rand(H, generator=torch.Generator().manual_seed(0)) + 0.5).to(torch.bfloat16)
    for name, quant, opts in formats.format_variants():
        kw = quant_kwargs(quant, opts)
        spec = formats.make_quant_spec(quant, **opts)
        for M in (1, 5, 130):
            g = torch.Generator().manual_seed(M * 7 + rank)
            x = (torch.randn(M, H, generator=g) * 2).to(torch.bfloat16)
            res = torch.randn(M, H, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
            xs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(xs, x)
            ref = allreduce_add_rmsnorm_ref(xs, res, w, 1e-6, norm_out=True, allreduce_out=True,
                                            **kw)
            outs = {"residual_out": poison_like(torch.empty_like(x)),
                    "y_out": poison_like(torch.empty_like(x))}
            if spec is not None:
                outs["q_out"] = poison_like(torch.empty(formats.q_shape(spec, M, H),
                                                        dtype=formats.q_dtype(spec)))
                if formats.scales_geometry(spec, M, H) is not None:
                    outs["scales_out"] = poison_like(formats.empty_scales(spec, M, H, "cpu"))
            out = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, norm_out=True,
                                                 allreduce_out=True, **kw, **outs)
            for field in ("residual", "y", "allreduce", "q", "scales"):
                a, b = getattr(out, field), getattr(ref, field)
                if a is None and b is None:
                    continue
                assert a.shape == b.shape, (name, M, field, a.shape, b.shape)
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
                    (name, M, field)
        s = distnorm.allreduce(x, workspace=ws)
        assert torch.equal(s, ref.allreduce)
    ws.close()


@pytest.mark.parametrize("world", [2, 3])
def test_every_format_bitwise_the_reference(world):
    spawn(_body, world, timeout_s=600, cpu_only=True)
