"""The torch.distributed path of the all-reduce ops (distnorm/collectives/rowsplit.py, its two
forms in nopeer.py, and the node chain of nodechain.py) on the CPU: gloo ranks and a CPU workspace. For every format and layout,
M from 1 to past a chunk, 2 and 3 ranks in one flat split, 4 and 6 ranks as 2 and 3 "nodes" of 2
(ranks_per_node=2), outputs are bitwise the reference over the gathered partial sums (the rank-order
fold; poisoned first), and the row split gives every row to exactly one rank."""
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


def _body(ranks_per_node=None, form=None) -> None:
    """form None: with allreduce_out (rowsplit.allreduce_by_slices); "gather" / "split" /
    "split-h": without it, the form of collectives/nopeer.py forced."""
    import os

    import torch.distributed as dist

    import distnorm
    from distnorm import formats
    from distnorm.reference import allreduce_add_rmsnorm_ref
    from quant_check import poison_like, quant_kwargs

    rank, world = dist.get_rank(), dist.get_world_size()
    # 4 KiB of buffer = 8 rows of H=256 bf16 per chunk: M=130 takes 17 chunks
    ws = distnorm.Workspace(dist.group.WORLD, device="cpu", buffer_bytes=4096,
                            ranks_per_node=ranks_per_node)
    if form is not None:
        os.environ["DISTNORM_NOPEER_FORM"] = form
    want_ar = form is None
    from distnorm.collectives.dispatch import row_split
    assert type(row_split(ws)).__name__ == ("NodeChain" if ranks_per_node else "FlatSplit")
    w = (torch.rand(H, generator=torch.Generator().manual_seed(0)) + 0.5).to(torch.bfloat16)
    for name, quant, opts in formats.format_variants():
        kw = quant_kwargs(quant, opts)
        spec = formats.make_quant_spec(quant, **opts)
        for M in (1, 5, 130):
            g = torch.Generator().manual_seed(M * 7 + rank)
            x = torch.randn(M, H, generator=g) * 2
            # + B on the first rank, - B on the last (B ~ 2^18, the same on every rank): the
            # running sum sits near B, where float32 rounds the small terms, and the result near
            # them, so a sum in another order than the ranks' shows in the bf16 outputs (bf16
            # values of like magnitude add exactly in any order and would hide it)
            big = torch.randn(M, H, generator=torch.Generator().manual_seed(M + 1)) * 2.0 ** 18
            x = (x + big if rank == 0 else x - big if rank == world - 1 else x).to(torch.bfloat16)
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
                                                 allreduce_out=want_ar, **kw, **outs)
            for field in ("residual", "y", "allreduce", "q", "scales"):
                a, b = getattr(out, field), getattr(ref, field)
                if (a is None and b is None) or (field == "allreduce" and not want_ar):
                    continue
                assert a.shape == b.shape, (name, M, field, a.shape, b.shape)
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
                    (name, M, field)
        s = distnorm.allreduce(x, workspace=ws)
        assert torch.equal(s, ref.allreduce)
    ws.close()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("form", [None, "gather", "split", "split-h"])
def test_every_format_bitwise_the_reference(world, form):
    """Every chunking: 4 KiB buffers make M = 130 many chunks in every form (swizzled scales in
    the gather form: 128 rows), with uneven slices (M = 5 over 2 or 3 ranks)."""
    spawn(_body, world, None, form, timeout_s=600, cpu_only=True)


@pytest.mark.parametrize("world, per_node", [(4, 2), (6, 2), (6, 3)])
def test_node_chain_bitwise_the_reference(world, per_node):
    """The running fold passes node to node: 2 nodes of 2, 3 nodes of 2 (a middle node), 2 nodes
    of 3 (slices of 3, empty ones at M = 1)."""
    spawn(_body, world, per_node, timeout_s=600, cpu_only=True)


def test_ranks_per_node_argument():
    from distnorm.comm.workspace import _ranks_per_node
    assert _ranks_per_node(None, 4) is None and _ranks_per_node(2, 4) == 2
    with pytest.raises(TypeError, match="ranks_per_node"):
        _ranks_per_node(2.0, 4)
    with pytest.raises(TypeError, match="ranks_per_node"):
        _ranks_per_node(True, 4)
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1 and divide the group size 4"):
        _ranks_per_node(3, 4)


def _subgroup_body() -> None:
    import torch.distributed as dist

    import distnorm

    sub = dist.new_group([0, 1, 2, 3])  # every process enters new_group
    if dist.get_rank() < 4:
        ws = distnorm.Workspace(sub, device="cpu", ranks_per_node=2)
        x = torch.randn(3, H).to(torch.bfloat16)
        with pytest.raises(ValueError, match="ranks_per_node needs a workspace whose group is the whole job"):
            distnorm.allreduce(x, workspace=ws)
        ws.close()
    # ranks 4 and 5 stay until 0-3 are done with their group: one run on an H200 machine (ranks
    # started from a fork server, since reverted) failed in new_group with Gloo's "Connection
    # closed by peer" while they may have been leaving
    dist.barrier()


def test_node_chain_refuses_a_subgroup():
    """A chain on 4 of 6 ranks would hang in dist.new_group; it raises instead."""
    spawn(_subgroup_body, 6, timeout_s=300, cpu_only=True)


def _gather_in_place_body() -> None:
    import torch.distributed as dist

    from distnorm.collectives.rowsplit import gather_in_place

    rank, world = dist.get_rank(), dist.get_world_size()
    for M, cols, dtype in ((1, 16, torch.uint8), (5, 8, torch.bfloat16), (130, 24, torch.float32)):
        S = -(-M // world)
        a, b = slice_bounds(M, world, rank)
        want = torch.arange(M * cols, dtype=torch.float32).reshape(M, cols).to(dtype)
        full = torch.full((world * S, cols), 77, dtype=dtype)  # rows not yet gathered: poison
        full[rank * S:rank * S + (b - a)] = want[a:b]
        got = gather_in_place(full, M, dist.group.WORLD)
        assert got.shape == want.shape and torch.equal(got, want), (M, dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_in_place(world):
    """Each rank's rows of the gathered tensor, written in place, end up on every rank (uneven
    shards, a rank without rows at M = 1; gloo: its input is copied out of the output first)."""
    spawn(_gather_in_place_body, world, timeout_s=120, cpu_only=True)


def test_overlapped_chunks_start_the_next_collective_before_the_fold():
    """NOTE [overlapped chunks]: chunk k + 1's collective is issued (asynchronously) before chunk
    k is finished, and every asynchronous chunk is waited on before its finish; without overlap
    (as in a CUDA-graph capture), or with one chunk, every collective is synchronous; the chunks
    cover the rows once."""
    from distnorm.collectives.nopeer import _overlapped

    log = []

    class Work:
        def __init__(self, a):
            self.a = a

        def wait(self):
            log.append(f"wait {self.a}")

    def start(a, b, async_op):
        log.append(f"start {a} {'async' if async_op else 'sync'}")
        return (a, b), (Work(a) if async_op else None)

    def finish(a, b, result):
        assert result == (a, b)
        assert f"wait {a}" in log or f"start {a} sync" in log
        log.append(f"finish {a}")

    for M, overlap, want in (
            (10, True, ["start 0 async", "start 4 async", "wait 0", "finish 0", "start 8 async",
                        "wait 4", "finish 4", "wait 8", "finish 8"]),
            (10, False, ["start 0 sync", "finish 0", "start 4 sync", "finish 4", "start 8 sync",
                         "finish 8"]),
            (3, True, ["start 0 sync", "finish 0"]),  # one chunk: nothing to overlap with
            (0, True, [])):  # no rows: nothing started
        log.clear()
        _overlapped(M, 4, start, finish, overlap)
        assert log == want, (M, overlap, log)


@pytest.mark.parametrize("table", ["fallback_h200_x2", "fallback_h200_x4", "fallback_h100_x4"])
def test_auto_form_is_the_fastest_of_the_latest_table(table, monkeypatch):
    """The latest committed no-peer table per world size and GPU (2 x H200, 4 x H200, 4 x H100;
    every form forced, per-token FP8 with a residual): at every row the form form_for picks is
    within 3% of the fastest."""
    from committed_tables import committed_table, slower_than_fastest
    from distnorm.collectives.nopeer import form_for, out_row_bytes
    from distnorm.formats import make_quant_spec

    monkeypatch.delenv("DISTNORM_NOPEER_FORM", raising=False)
    run = committed_table(table)
    spec = make_quant_spec("fp8_per_token")
    slow = []
    for row in run["rows"]:
        M, H = row["M"], row["H"]
        out = out_row_bytes(spec, H, torch.bfloat16, True, False)
        form = form_for(M, H, run["meta"]["world"], 2, out, True)
        us = {k: row[k] for k in ("gather", "split", "split-h")}
        if slower_than_fastest(us, form):
            slow.append((M, H, form, us))
    assert not slow, slow


def test_auto_form_by_received_bytes(monkeypatch):
    """NOTE [no-peer forms]: the form measured fastest on each side of each measured crossover
    (2 ranks: gather at 32 MiB of x, split-h at 64 MiB; 4 ranks: gather at 16 rows, split-h from
    128), never split with a residual, never split-h without one."""
    from distnorm.collectives.nopeer import form_for

    monkeypatch.delenv("DISTNORM_NOPEER_FORM", raising=False)
    out = 8192 + 2 * 8192  # residual + y bytes of a row at H = 8192: only split counts them
    assert form_for(1, 4096, 2, 2, out, True) == "gather"
    assert form_for(2048, 8192, 2, 2, out, True) == "gather"  # 32 MiB
    assert form_for(8192, 4096, 2, 2, out, True) == "split-h"  # 64 MiB
    assert form_for(16384, 8192, 2, 2, out, True) == "split-h"
    assert form_for(16384, 8192, 2, 2, out, False) == "gather"
    for H in (4096, 8192):
        assert form_for(1, H, 4, 2, out, True) == "gather"
        assert form_for(16, H, 4, 2, out, True) == "gather"
        for M in (128, 512, 2048, 16384):  # split took 128 x 8192 with the old constants
            assert form_for(M, H, 4, 2, out, True) == "split-h", (M, H)
    for M in range(1, 4096, 37):
        assert form_for(M, 4096, 8, 2, out, True) != "split"
    monkeypatch.setenv("DISTNORM_NOPEER_FORM", "split-h")
    assert form_for(1, 4096, 2, 2, out, False) == "split"
