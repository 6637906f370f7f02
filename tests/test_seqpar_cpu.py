"""The sequence-parallel ops (distnorm/collectives/seqpar.py) on the CPU: gloo ranks, CPU
workspace. Every format and layout, M = 0 .. past 128 at 2 and 3 ranks (shards of unequal size
and empty ones): the shard's outputs are bitwise allreduce_add_rmsnorm's rows, and gathered q /
scales (gather=True, or all_gather + all_gather_scales) are bitwise allreduce_add_rmsnorm's for
all M (incl. the 128x4 swizzled scales re-tiled across shard boundaries)."""
from __future__ import annotations

import pytest
import torch

from distnorm.launch import spawn

H = 256


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape, (what, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                           b.reshape(-1).contiguous().view(torch.uint8)), what


def _body() -> None:
    import torch.distributed as dist

    import distnorm
    from distnorm import formats
    from quant_check import quant_kwargs

    rank = dist.get_rank()
    ws = distnorm.Workspace(dist.group.WORLD, device="cpu")
    w = (torch.rand(H, generator=torch.Generator().manual_seed(0)) + 0.5).to(torch.bfloat16)
    for name, quant, opts in formats.format_variants():
        kw = quant_kwargs(quant, opts)
        for M in (0, 1, 5, 130):
            x = (torch.randn(M, H, generator=torch.Generator().manual_seed(M + 17 * rank)) * 2
                 ).to(torch.bfloat16)
            res = torch.randn(M, H, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
            full = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, norm_out=True,
                                                  **kw)
            a, b = distnorm.shard_rows(M, ws)
            shard = distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6, workspace=ws,
                                                        norm_out=True, **kw)
            what = f"{name} M={M}"
            _same(shard.residual, full.residual[a:b], what + " residual")
            _same(shard.y, full.y[a:b], what + " y")
            if quant is None:
                continue
            _same(shard.q, full.q[a:b], what + " q")
            gathered = distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6, workspace=ws,
                                                           gather=True, **kw)
            _same(gathered.q, full.q, what + " gathered q")
            _same(distnorm.all_gather(shard.q, workspace=ws, rows=M), full.q, what + " all_gather q")
            if quant == "fp8":
                continue
            _same(gathered.scales, full.scales, what + " gathered scales")
            opts_s = {k: v for k, v in opts.items()}
            s = distnorm.all_gather_scales(shard.scales, workspace=ws, rows=M, hidden=H,
                                           quant=quant, **opts_s)
            _same(s, full.scales, what + " all_gather_scales")
    # under torch.compile(fullgraph=True): the torch.library op, same bits as eager
    x = torch.randn(2, 5, H).to(torch.bfloat16)
    a, b = distnorm.shard_rows(10, ws)
    r = torch.randn(b - a, H).to(torch.bfloat16)
    for quant, gather in (("fp8_per_token", True), ("nvfp4", False), (None, True)):
        kw = quant_kwargs(quant, {})

        def f(x, r):
            return distnorm.reduce_scatter_add_rmsnorm(x, r, w, 1e-6, workspace=ws, gather=gather,
                                                       norm_out=True, **kw)
        eager, compiled = f(x, r), torch.compile(f, fullgraph=True)(x, r)
        for field in ("residual", "y", "q", "scales"):
            _same(getattr(compiled, field), getattr(eager, field), f"compiled {quant} {field}")
    bad = torch.zeros(8, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):  # static FP8 without its scale
        distnorm.reduce_scatter_add_rmsnorm(bad, None, w, workspace=ws, quant="fp8")
    with pytest.raises(ValueError, match="weight"):
        distnorm.reduce_scatter_add_rmsnorm(bad, None, w[:128], workspace=ws)
    with pytest.raises(ValueError, match="residual must have shape"):
        distnorm.reduce_scatter_add_rmsnorm(torch.zeros(8, H, dtype=torch.bfloat16),
                                            torch.zeros(8, H, dtype=torch.bfloat16), w,
                                            workspace=ws)
    # rows that do not start at 16-byte boundaries: the library's message, on the CPU as on GPUs
    with pytest.raises(ValueError, match="x rows must start at 16-byte"):
        distnorm.reduce_scatter_add_rmsnorm(torch.zeros(8, H + 1, dtype=torch.bfloat16)[:, 1:],
                                            None, w, workspace=ws)
    a, b = distnorm.shard_rows(8, ws)
    with pytest.raises(ValueError, match="residual rows must start at 16-byte"):
        distnorm.reduce_scatter_add_rmsnorm(torch.zeros(8, H, dtype=torch.bfloat16),
                                            torch.zeros(b - a, H + 4, dtype=torch.bfloat16)[:, 4:],
                                            w, workspace=ws)
    with pytest.raises(TypeError, match="gather must be a bool"):  # "False" would gather
        distnorm.reduce_scatter_add_rmsnorm(bad, None, w, workspace=ws, gather="False")
    # the all-reduce ops' checked path refuses outputs overlapping x by a row (a race on GPUs)
    rows = torch.randn(9, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="y_out overlaps x"):
        distnorm.allreduce_add_rmsnorm(rows[:8], None, w, workspace=ws, y_out=rows[1:])
    with pytest.raises(ValueError, match="out overlaps x"):
        distnorm.allreduce(rows[:8], workspace=ws, out=rows[1:])
    # the gathers and the row split: counts and shards named, never an operator's TypeError
    with pytest.raises(TypeError, match="rows must be an int"):
        distnorm.all_gather(bad[:4], workspace=ws, rows="8")
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        distnorm.all_gather([1.0], workspace=ws, rows=8)
    with pytest.raises(ValueError, match="M must be >= 0"):
        distnorm.shard_rows(-3, ws)
    nv = dict(quant="nvfp4", sf_layout="linear")
    with pytest.raises(ValueError, match=f"scales must be this rank's {b - a} of 8 rows"):
        distnorm.all_gather_scales(torch.empty(b - a, 3, dtype=torch.float8_e4m3fn), workspace=ws,
                                   rows=8, hidden=H, **nv)
    with pytest.raises(ValueError, match="hidden size H=100"):
        distnorm.all_gather_scales(torch.empty(b - a, 6, dtype=torch.float8_e4m3fn), workspace=ws,
                                   rows=8, hidden=100, **nv)
    ws.close()


@pytest.mark.parametrize("world", [2, 3])
def test_shards_and_gathers_bitwise_allreduce(world):
    spawn(_body, world, timeout_s=600, cpu_only=True)


class _FakeRows:
    """What _kernel_chunk reads of x: a CUDA tensor's shape and element size."""

    is_cuda = True

    def __init__(self, M: int, H: int) -> None:
        self.shape = (M, H)

    def element_size(self) -> int:
        return 2


def _fake_workspace(**kw):
    """What _kernel_chunk reads of a workspace, with its per-workspace op state."""
    from types import SimpleNamespace

    states: dict = {}
    return SimpleNamespace(op_state=lambda name, cls: states.setdefault(name, cls()), **kw)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_reduce_scatter_chunk_rule(world, caplog):
    """NOTE [reduce-scatter chunks]: one launch when the call fits; chunks of the shard (whole
    128-row tiles for swizzled scales) when it does not and M splits evenly; else 0
    (torch.distributed, logged once per workspace)."""
    from distnorm import formats
    from distnorm.collectives.plan import max_chunk_rows
    from distnorm.collectives.seqpar import _kernel_chunk

    H, buf = 4096, 16 << 20
    ws = _fake_workspace(p2p_ok=True, world_size=world, buffer_bytes=buf)
    cap = max_chunk_rows("reducescatter", world, 1, H, 2, buf, False, False)
    nvfp4 = formats.make_quant_spec("nvfp4")
    assert _kernel_chunk(ws, _FakeRows(cap, H), None) == -(-cap // world)  # fits: the shard
    M = world * cap  # does not fit, splits evenly
    assert _kernel_chunk(ws, _FakeRows(M, H), None) == cap // world
    with caplog.at_level("WARNING", logger="distnorm.collectives.seqpar"):
        for _ in range(3):  # uneven: torch.distributed
            assert _kernel_chunk(ws, _FakeRows(M + 1, H), None) == 0
    assert sum("do not split evenly" in r.getMessage() for r in caplog.records) == 1
    # swizzled scales: whole 128-row tiles per rank, or torch.distributed naming that reason (at
    # 8 ranks 16 MiB holds 96 rows of each shard, fewer than a tile)
    tiles = _fake_workspace(p2p_ok=True, world_size=world, buffer_bytes=buf)
    caplog.clear()
    with caplog.at_level("WARNING", logger="distnorm.collectives.seqpar"):
        assert _kernel_chunk(tiles, _FakeRows(M, H), nvfp4) == cap // world // 128 * 128
    assert (cap // world >= 128) == (not caplog.records)
    assert all("fewer than one 128-row tile" in r.getMessage() for r in caplog.records)
    assert _kernel_chunk(_fake_workspace(p2p_ok=False, world_size=world, buffer_bytes=buf),
                         _FakeRows(M, H), None) == 0


@pytest.mark.parametrize("spec_name", [None, "fp8_per_token", "nvfp4"])
def test_reduce_scatter_chunks_take_each_shards_rows(monkeypatch, spec_name):
    """NOTE [reduce-scatter chunks]: launch k gets rows [k c, (k + 1) c) of every rank's shard in
    one contiguous x (block r = rank r's), and writes the shard's rows [k c, (k + 1) c) of every
    output. A stand-in launch writes h = x's block `rank` + residual and q / scales / y that name
    their rows; the outputs after all chunks must be exactly those of one launch."""
    from types import SimpleNamespace

    import distnorm.collectives.seqpar as seqpar
    import distnorm.collectives.state as state
    from distnorm import formats

    world, rank, local, H, chunk = 3, 1, 300, 64, 128
    spec = formats.make_quant_spec(spec_name) if spec_name else None
    launches = []

    def launch(ws, st, x, residual, residual_out, weight, y_out, q_out, scales_out, *rest):
        rows = x.shape[0] // world
        mine = x[rank * rows:(rank + 1) * rows]
        launches.append(rows)
        residual_out.copy_(mine + residual)
        if y_out is not None:
            y_out.copy_(mine)
        if q_out is not None:
            q_out.view(torch.uint8).copy_(mine[:, :q_out.shape[1]].view(torch.uint8)[:, ::2])
        if scales_out is not None:
            scales_out.view(torch.uint8).fill_(len(launches))

    monkeypatch.setattr(seqpar, "_launch_scatter", launch)
    monkeypatch.setattr(state, "state_of", lambda ws: None)
    ws = SimpleNamespace(world_size=world, rank=rank)
    # rows with a stride past H (a slice of a wider buffer): the chunks' blocks are views of it
    x = torch.randn(world * local, H + 16).to(torch.bfloat16)[:, :H]
    res = torch.randn(local, H).to(torch.bfloat16)
    args = (ws, x, res, None, 1e-6, spec, None, None, False, True, local, {})
    one = seqpar._shard_by_kernel(*args, local)
    assert launches == [local]
    chunked = seqpar._shard_by_kernel(*args, chunk)
    assert launches[1:] == [128, 128, 44]
    _same(chunked.residual, one.residual, "h")
    _same(chunked.y, one.y, "y")
    _same(chunked.q, one.q, "q")
    if spec is not None and spec.block_scaled and spec.swizzled:  # chunk k's tiles say k
        tiles = chunked.scales.view(torch.uint8).reshape(3, -1)  # 300 rows: 3 tiles of 128
        assert [int(t[0]) for t in tiles] == [2, 3, 4], "swizzled scale tiles per launch"


def test_q_gathered_in_the_epilogue_only_where_it_fits():
    """NOTE [gather in the epilogue]: the reduce-scatter gathers q itself when Tuning.gather_by is
    "epilogue", q rows are whole 16-byte units, every rank's q rows fit the upper half of the
    buffer's general part and no shard is empty; the rule reads only the call and the workspace."""
    import dataclasses
    import types

    from distnorm.collectives.layout import lamport_split, push_half
    from distnorm.collectives.seqpar import _q_in_epilogue
    from distnorm.collectives.state import AllReduceState
    from distnorm.formats import make_quant_spec

    class FakeWorkspace(types.SimpleNamespace):
        def op_state(self, name, make):
            return self.states.setdefault(name, make())

    for world in (2, 4, 8):
        for buffer_bytes in (1 << 20, 64 << 20):
            ws = FakeWorkspace(world_size=world, buffer_bytes=buffer_bytes,
                               states={"allreduce": AllReduceState()})
            general = lamport_split(buffer_bytes)[0]
            upper = general - push_half(general)
            for quant, H, q_row in (("fp8", 4096, 4096), ("nvfp4", 7168, 3584),
                                    ("fp8_per_token", 2888, 2888)):
                spec = make_quant_spec(quant)
                for M in (1, 3, world - 1, world, 127, 4099, 16384):
                    S = -(-M // world)
                    want = (q_row % 16 == 0 and world * S * q_row <= upper
                            and M - (world - 1) * S > 0)
                    assert _q_in_epilogue(ws, spec, M, H) == want, (world, buffer_bytes, quant, M)
                    if M == 4099 and q_row % 16 == 0 and buffer_bytes == 64 << 20:
                        assert want  # the common case takes it
            state = ws.states["allreduce"]
            state.tuning = dataclasses.replace(state.tuning, gather_by="peers")
            assert not _q_in_epilogue(ws, make_quant_spec("fp8"), 4099, 4096)


def test_gathered_scales_in_place_where_the_layout_allows():
    """seqpar's NOTE [gathered scales]: row-major scales are always their rows of the full output;
    swizzled ones only when every shard is whole 128-row tiles (M = N x S, S % 128 == 0), whose
    tiles then concatenate; column-major ones never. And the claim itself: a swizzled shard of S
    whole tiles is rows [r S, (r + 1) S) of the full M's swizzled tensor."""
    from distnorm.collectives.rowsplit import linear_spec, scales_to_layout
    from distnorm.collectives.seqpar import _scales_in_place
    from distnorm.formats import empty_scales, make_quant_spec

    nvfp4, mxfp8 = make_quant_spec("nvfp4"), make_quant_spec("mxfp8")
    for spec in (nvfp4, mxfp8):
        assert _scales_in_place(spec, 512, 256, 2) and _scales_in_place(spec, 512, 128, 4)
        assert not _scales_in_place(spec, 512, 64, 8)  # 64-row shards share a tile
        assert not _scales_in_place(spec, 500, 256, 2)  # the last shard is short
        assert not _scales_in_place(spec, 0, 0, 2)
        assert _scales_in_place(linear_spec(spec), 4099, 2050, 2)
    assert _scales_in_place(make_quant_spec("fp8_per_token"), 3, 2, 2)
    assert _scales_in_place(make_quant_spec("fp8_per_group"), 129, 65, 2)
    assert not _scales_in_place(make_quant_spec("fp8_per_group", scale_major="col"), 512, 256, 2)

    H, M, world = 1024, 512, 2
    S = M // world
    K = H // nvfp4.group_size
    linear = torch.randint(1, 255, (M, K), dtype=torch.uint8).view(nvfp4.info.scale_dtype)
    full = empty_scales(nvfp4, M, H, "cpu")
    scales_to_layout(linear, nvfp4, full)
    for r in range(world):
        shard = empty_scales(nvfp4, S, H, "cpu")
        scales_to_layout(linear[r * S:(r + 1) * S], nvfp4, shard)
        assert torch.equal(shard.view(torch.uint8), full[r * S:(r + 1) * S].view(torch.uint8))


@pytest.mark.parametrize("spec_name", ["fp8_per_token", "mxfp4", "nvfp4"])
def test_kernel_writes_the_given_gathered_rows(monkeypatch, spec_name):
    """gather=True on the kernel path: y, q and (NOTE [gathered scales]) scales are written into
    the views of the gathered tensors it is given, not into tensors of its own (the GPU test found
    scales dropped that way: the gathered scales were never written)."""
    from types import SimpleNamespace

    import distnorm.collectives.seqpar as seqpar
    import distnorm.collectives.state as state
    from distnorm import formats

    world, rank, S, H = 2, 1, 256, 128
    spec = formats.make_quant_spec(spec_name)
    written = {}

    def launch(ws, st, x, residual, residual_out, weight, y_out, q_out, scales_out, *rest):
        written.update(y=y_out, q=q_out, scales=scales_out)

    monkeypatch.setattr(seqpar, "_launch_scatter", launch)
    monkeypatch.setattr(state, "state_of", lambda ws: None)
    full = {"y": torch.empty(world * S, H, dtype=torch.bfloat16),
            "q": torch.empty(formats.q_shape(spec, world * S, H), dtype=formats.q_dtype(spec)),
            "scales": formats.empty_scales(spec, world * S, H, "cpu")}
    given = {k: t[rank * S:(rank + 1) * S] for k, t in full.items()}
    x = torch.randn(world * S, H).to(torch.bfloat16)
    seqpar._shard_by_kernel(SimpleNamespace(world_size=world, rank=rank), x, None, None, 1e-6,
                            spec, None, None, False, True, S, given, S)
    for k, t in given.items():
        assert written[k] is not None and written[k].data_ptr() == t.data_ptr(), k


@pytest.mark.parametrize("gather_by", ["epilogue", "epilogue-swizzled"])
def test_kernel_spec_pushes_scales_only_when_the_host_expects_them(gather_by):
    """The kernel of the returned spec pushes scale rows (pushed_scale_row_bytes > 0, as the
    kernel decides it) exactly when the host counts its scales as gathered by it, for every
    layout, column-major included (computed row-major by the kernel, linear_spec): a kernel that
    pushes scales the host did not plan for writes into rows the host does not read (seen on
    2 x H200: per-group column-major shard scales wrong at M = 130)."""
    import dataclasses

    from distnorm import formats
    from distnorm.collectives.seqpar import _kernel_gathers
    from distnorm.collectives.state import state_of
    from distnorm.formats import pushed_scale_row_bytes

    specs = [formats.make_quant_spec(q, **kw) for q, kw in (
        ("fp8", {}), ("fp8_per_token", {}), ("fp8_per_group", {}),
        ("fp8_per_group", {"scale_major": "col"}), ("nvfp4", {}), ("nvfp4", {"sf_layout": "linear"}),
        ("mxfp8", {}), ("mxfp4", {}), ("mxfp4", {"sf_layout": "linear"}))]
    for world in (2, 4, 8):
        ws = _fake_workspace(p2p_ok=True, world_size=world, buffer_bytes=256 << 20)
        state_of(ws).tuning = dataclasses.replace(state_of(ws).tuning, gather_by=gather_by)
        for H in (2880, 4096, 7168):  # 2880: MXFP4 rows of 90 bytes, NVFP4 of 180
            for spec in specs:
                has_scales = formats.scales_geometry(spec, 1, H) is not None
                for M in (1, 130, 2048, 4099):
                    chunk, kspec, q_gathered, s_gathered, _ = _kernel_gathers(
                        ws, _FakeRows(M, H), spec, True, has_scales)
                    if q_gathered:
                        pushes = has_scales and pushed_scale_row_bytes(kspec, H) > 0
                        assert pushes == s_gathered, (world, H, spec, M, kspec, s_gathered)
                    if spec.col_major:
                        assert not kspec.col_major, (world, H, spec, M)


def test_scales_pushed_with_q_where_their_rows_fit(monkeypatch):
    """NOTE [gathered scales] / [gather in the epilogue]: with gather=True in one launch, scales
    whose row-major linear rows are whole 4-byte units go with q (the kernel's spec then has
    linear scales, written into the gathered tensor: per-token's too; with gather_by
    "epilogue-swizzled" swizzled ones stay swizzled, the kernel laying out the whole output:
    NOTE [swizzled scales gathered]); scales of other rows
    (MXFP4 at H = 2880: 90 bytes) leave q to the kernel and keep their own rule; a spec whose rows would be
    pushed but do not fit the q area leaves everything to the row gather (its kernel would push
    them: no rsgather). The plain reduce-scatter and chunked calls never gather."""
    import dataclasses

    import distnorm.collectives.seqpar as seqpar
    from distnorm import formats
    from distnorm.collectives.layout import lamport_split, push_half
    from distnorm.collectives.rowsplit import linear_spec
    from distnorm.collectives.seqpar import _kernel_gathers
    from distnorm.collectives.state import state_of

    world, H, M = 2, 4096, 2048
    S = M // world
    nvfp4, per_token = formats.make_quant_spec("nvfp4"), formats.make_quant_spec("fp8_per_token")
    mxfp4, fp8 = formats.make_quant_spec("mxfp4"), formats.make_quant_spec("fp8")
    big = _fake_workspace(p2p_ok=True, world_size=world, buffer_bytes=256 << 20)
    x = _FakeRows(M, H)
    assert state_of(big).tuning.gather_by == "epilogue-swizzled"  # the default
    state_of(big).tuning = dataclasses.replace(state_of(big).tuning, gather_by="epilogue")
    assert _kernel_gathers(big, x, nvfp4, True, True) == (S, linear_spec(nvfp4), True, True, True)
    # gather_by "epilogue-swizzled": swizzled scales stay swizzled (the kernel lays out the whole
    # output), shards of whole 128-row tiles or not; other layouts as before
    state_of(big).tuning = dataclasses.replace(state_of(big).tuning, gather_by="epilogue-swizzled")
    assert _kernel_gathers(big, x, nvfp4, True, True) == (S, nvfp4, True, True, True)
    assert _kernel_gathers(big, _FakeRows(2 * 200, H), nvfp4, True, True) == (
        200, nvfp4, True, True, True)
    assert _kernel_gathers(big, _FakeRows(2 * S + 1, H), nvfp4, True, True)[1:] == (
        nvfp4, True, True, True)
    assert _kernel_gathers(big, x, per_token, True, True) == (S, per_token, True, True, True)
    assert _kernel_gathers(big, _FakeRows(2 * 200, 2880), mxfp4, True, True) == (  # 90-byte rows
        200, linear_spec(mxfp4), True, False, False)
    state_of(big).tuning = dataclasses.replace(state_of(big).tuning, gather_by="epilogue")
    assert _kernel_gathers(big, x, per_token, True, True) == (S, per_token, True, True, True)
    assert _kernel_gathers(big, x, nvfp4, False, True) == (S, nvfp4, False, False, False)
    odd = _kernel_gathers(big, _FakeRows(2 * 200, 2880), mxfp4, True, True)  # 90-byte rows
    assert odd == (200, linear_spec(mxfp4), True, False, False)  # 200 rows: not whole tiles
    # q fits the q area, q and its scales do not (a buffer of that size): no epilogue gather
    q_bytes = world * S * H // 2
    buf = next(b for b in range(1 << 20, 64 << 20, 1 << 16)
               if q_bytes <= (lambda g: g - push_half(g))(lamport_split(b)[0])
               < q_bytes + world * S * H // 16)
    tight = _fake_workspace(p2p_ok=True, world_size=world, buffer_bytes=buf)
    assert seqpar._q_in_epilogue(tight, nvfp4, M, H)
    assert not seqpar._q_in_epilogue(tight, nvfp4, M, H, H // 16)
    monkeypatch.setattr(seqpar, "_q_in_epilogue", lambda ws, spec, M, H, srb=0: srb == 0)
    assert _kernel_gathers(big, x, nvfp4, True, True)[2:4] == (False, False)
    assert _kernel_gathers(big, x, per_token, True, True)[2:4] == (False, False)
    assert _kernel_gathers(big, x, fp8, True, False)[2:4] == (True, False)  # no scales
    monkeypatch.undo()
    state = state_of(big)
    state.tuning = dataclasses.replace(state.tuning, gather_by="peers")
    assert _kernel_gathers(big, x, nvfp4, True, True)[2:4] == (False, False)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_rowsplit_gpu_chunking_workspace_chunks(world, monkeypatch):
    """tests/multigpu/test_rowsplit_gpu.py's chunking workspace makes M = 2000 run in several
    launches in every format at 2, 4 and 8 ranks (at 8, 16 MiB held less than a swizzled scale tile
    per rank: the call went to torch.distributed and the GPU test's chunk check failed,
    2026-12-07, 8 ranks sharing one H100)."""
    import os

    from distnorm import formats
    from distnorm.collectives.seqpar import _kernel_chunk

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "multigpu"))
    from test_rowsplit_gpu import QUANTS, small_buffer_mib

    M, H = 2000, 4096
    shard = -(-M // world)
    for quant, opts in QUANTS.values():
        ws = _fake_workspace(p2p_ok=True, world_size=world,
                             buffer_bytes=small_buffer_mib(world) << 20)
        per_launch = _kernel_chunk(ws, _FakeRows(M, H), formats.make_quant_spec(quant, **opts))
        assert 0 < per_launch < shard, (quant, opts, per_launch)
