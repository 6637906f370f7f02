"""The torch.distributed (NCCL) path on GPUs, forced with Workspace(backend="none") as on a group
that spans nodes: every output bitwise the peer kernels' (every format, several M; on the peer
side one algorithm per format, rotating, or every algorithm with DISTNORM_FULL=1: the algorithms
agree bitwise, test_allreduce_gpu.py::test_batch_invariance); at 4+ ranks (even) also the node
chain (ranks_per_node=2); and the sequence-parallel ops, by NCCL and by the reducescatter kernel: shards and gathers bitwise
allreduce_add_rmsnorm's, shard scales equal between the two. Inputs carry +B on the first rank and
-B on the last (tests/test_rowsplit_cpu.py says why): a sum in another order than the ranks' shows."""
from __future__ import annotations

import contextlib
import os
import sys

import torch

from harness import MULTIGPU_MARKS, Expectations, gathered_check
from distnorm.collectives.plan import GATHERS_IN_EPILOGUE
from distnorm.launch import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = MULTIGPU_MARKS
FULL = os.environ.get("DISTNORM_FULL") == "1"
ALGOS = ("oneshot", "twoshot", "lamport")
QUANTS = {"none": (None, {}), "fp8": ("fp8", {}), "fp8_per_token": ("fp8_per_token", {}),
          "fp8_g128_col": ("fp8_per_group", {"scale_major": "col"}),
          "nvfp4": ("nvfp4", {}), "mxfp4_linear": ("mxfp4", {"sf_layout": "linear"})}


def _bytes(t):
    return None if t is None else t.reshape(-1).contiguous().view(torch.uint8)


def _poisoned_outputs(quant, opts, M: int, H: int, in_place: bool) -> dict:
    """Every output of allreduce_add_rmsnorm (norm_out, bf16 [M, H] rows), NaN / 0xFF-filled."""
    from distnorm import formats
    from quant_check import poison_like

    spec = formats.make_quant_spec(quant, **opts)
    outs = {"residual_out": torch.empty(M, H, device="cuda", dtype=torch.bfloat16),
            "y_out": poison_like(torch.empty(M, H, device="cuda", dtype=torch.bfloat16))}
    if not in_place:
        poison_like(outs["residual_out"])
    if spec is not None:
        outs["q_out"] = poison_like(torch.empty(formats.q_shape(spec, M, H),
                                                dtype=formats.q_dtype(spec), device="cuda"))
        if formats.scales_geometry(spec, M, H) is not None:
            outs["scales_out"] = poison_like(formats.empty_scales(spec, M, H, "cuda"))
    return outs


def small_buffer_mib(world: int) -> int:
    """The chunking workspace of _body: M = 2000 must need several launches of at least one
    128-row scale tile per rank (tests/test_seqpar_cpu.py checks it at worlds 2, 4 and 8)."""
    return 16 if world <= 4 else 32


def _body() -> None:
    import distnorm
    from distnorm import formats
    from distnorm.collectives.seqpar import _kernel_chunk
    from distnorm.comm import resolve_bootstrap
    from quant_check import quant_kwargs

    boot = resolve_bootstrap(None)
    peer = distnorm.Workspace(buffer_bytes=32 << 20)
    nccl = distnorm.Workspace(backend="none", buffer_bytes=4 << 20)  # 4 MiB: chunks at M=2000
    world = peer.world_size
    # the reduce-scatter of M = 2000 runs in launches of 384 / 192 rows per shard (16 MiB at 2 / 4
    # ranks; swizzled scales 256 / 128) or 192 (32 MiB at 8 ranks: 16 MiB holds 96 rows per shard,
    # fewer than a swizzled scale tile), the last one partial (NOTE [reduce-scatter chunks])
    small = distnorm.Workspace(buffer_bytes=small_buffer_mib(world) << 20)
    assert peer.p2p_ok and not nccl.p2p_ok and "none" in nccl.fallback_reason
    chain = (distnorm.Workspace(backend="none", buffer_bytes=4 << 20, ranks_per_node=2)
             if world >= 4 and world % 2 == 0 else None)

    def check():
        expect = Expectations()  # every rank makes every call, whatever it finds
        H = 4096
        w = (torch.rand(H, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
             + 0.5).to(torch.bfloat16)
        for k, (name, (quant, opts)) in enumerate(QUANTS.items()):
            kw = quant_kwargs(quant, opts, "cuda")
            peer_algos = ALGOS if FULL else (ALGOS[k % len(ALGOS)],)
            for M in (1, 130, 2000):
                g = torch.Generator("cuda").manual_seed(M * 13 + peer.rank)
                x = torch.randn(M, H, device="cuda", generator=g) * 2
                big = torch.randn(M, H, device="cuda", generator=torch.Generator("cuda")
                                  .manual_seed(M + 1)) * 2.0 ** 18
                if peer.rank in (0, world - 1):
                    x = x + big if peer.rank == 0 else x - big
                x = x.to(torch.bfloat16)
                res = torch.randn(M, H, device="cuda", generator=torch.Generator("cuda")
                                  .manual_seed(M)).to(torch.bfloat16)
                got = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=nccl,
                                                     norm_out=True, allreduce_out=True, **kw)
                # without allreduce_out: collectives/nopeer.py
                for form in ("gather", "split", "split-h"):
                    os.environ["DISTNORM_NOPEER_FORM"] = form
                    in_place = form != "gather"
                    outs = _poisoned_outputs(quant, opts, M, H, in_place=in_place)
                    if in_place:
                        outs["residual_out"].copy_(res)  # vLLM's form: h written over residual
                    by_form = distnorm.allreduce_add_rmsnorm(
                        x, outs["residual_out"] if in_place else res, w, 1e-6,
                        workspace=nccl, norm_out=True, **kw, **outs)
                    os.environ.pop("DISTNORM_NOPEER_FORM")
                    for field in ("residual", "y", "q", "scales"):
                        a, b = _bytes(getattr(by_form, field)), _bytes(getattr(got, field))
                        expect((a is None) == (b is None) and (a is None or torch.equal(a, b)),
                               f"{name} M={M}: {form} form's {field} differs from the row split")
                if chain is not None:
                    by_chain = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=chain,
                                                              norm_out=True, allreduce_out=True, **kw)
                    for field in ("residual", "y", "q", "scales", "allreduce"):
                        a, b = _bytes(getattr(by_chain, field)), _bytes(getattr(got, field))
                        expect((a is None) == (b is None) and (a is None or torch.equal(a, b)),
                               f"{name} M={M}: node chain {field} differs from the flat split")
                for algo in peer_algos:
                    want = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=peer,
                                                          algo=algo, norm_out=True,
                                                          allreduce_out=True, **kw)
                    for field in ("residual", "y", "q", "scales", "allreduce"):
                        a, b = _bytes(getattr(got, field)), _bytes(getattr(want, field))
                        expect((a is None) == (b is None) and (a is None or torch.equal(a, b)),
                               f"{name} M={M} {algo}: {field} differs from the peer path")
                a, b = distnorm.shard_rows(M, nccl)
                shards = {}
                # peer: the reducescatter kernel; small: the same in chunks at M = 2000
                for label, ws in (("nccl", nccl), ("kernel", peer), ("chunks", small)):
                    shards[label] = distnorm.reduce_scatter_add_rmsnorm(
                        x, res[a:b], w, 1e-6, workspace=ws, norm_out=True, **kw)
                    full = distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6, workspace=ws,
                                                               gather=True, **kw)
                    tag = f"{name} M={M} {label}"
                    expect(torch.equal(shards[label].residual, want.residual[a:b]),
                           tag + " shard h")
                    expect(torch.equal(shards[label].y, want.y[a:b]), tag + " shard y")
                    if quant is not None:
                        expect(torch.equal(_bytes(full.q), _bytes(want.q)), tag + " gathered q")
                        expect(torch.equal(_bytes(shards[label].q), _bytes(want.q[a:b])),
                               tag + " shard q")
                        if quant != "fp8":
                            expect(torch.equal(_bytes(full.scales), _bytes(want.scales)),
                                   tag + " gathered scales")
                for label in ("kernel", "chunks"):  # the shard's own layout (swizzled: its rows)
                    sa, sb = shards["nccl"].scales, shards[label].scales
                    expect((sa is None) == (sb is None) and (sa is None or torch.equal(
                        _bytes(sa), _bytes(sb))), f"{name} M={M}: {label} shard scales differ")
                if M == 2000:  # the small workspace did chunk (not torch.distributed)
                    per_launch = _kernel_chunk(small, x, formats.make_quant_spec(quant, **opts))
                    expect(0 < per_launch < b - a, f"{name}: {per_launch} rows per launch")
        torch.cuda.synchronize()
        expect.raise_any()

    def graphs():  # the sequence-parallel op and the no-peer forms replay in a CUDA graph
        from quant_check import poison_like

        H, M = 4096, 300
        gs = torch.tensor([448 * 6 / 12.0], device="cuda")
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
        a, b = distnorm.shard_rows(M, peer)
        r = torch.randn(b - a, H, device="cuda").to(torch.bfloat16)
        for ws in (peer, nccl):
            def f():
                return distnorm.reduce_scatter_add_rmsnorm(x, r, w, workspace=ws,
                                                           quant="fp8_per_token", gather=True)
            want = f()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = f()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            assert torch.equal(_bytes(got.q), _bytes(want.q)) and torch.equal(got.scales, want.scales)
            assert torch.equal(got.residual, want.residual)
        res = torch.randn(M, H, device="cuda").to(torch.bfloat16)
        for form in ("gather", "split"):  # the fused all-reduce without peer memory, both forms
            os.environ["DISTNORM_NOPEER_FORM"] = form
            try:
                kw = ({"quant": "nvfp4", "global_scale": gs} if form == "split" else
                      {"quant": "fp8_per_token"})

                def f():
                    return distnorm.allreduce_add_rmsnorm(x, res, w, workspace=nccl, **kw)
                want = f()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    got = f()
                for t in (got.residual, got.q, got.scales):
                    poison_like(t)
                g.replay()
                torch.cuda.synchronize()
            finally:
                os.environ.pop("DISTNORM_NOPEER_FORM")
            for a, b in ((got.residual, want.residual), (got.q, want.q), (got.scales, want.scales)):
                assert torch.equal(_bytes(a), _bytes(b)), f"{form} form in a CUDA graph"
    try:
        gathered_check(boot, check)
        import torch.distributed as dist
        if dist.get_backend() == "nccl":  # gather=True gathers by torch.distributed: gloo (ranks
            gathered_check(boot, graphs)  # sharing a GPU) cannot be captured
    finally:
        for ws in (peer, nccl, chain, small):
            if ws is not None:
                ws.close()


def kernel_keys(test: str, params: dict) -> list[tuple]:
    """The kernels _body's check() compiles (distnorm.kernels.precompile keys; tests/conftest.py
    compiles them ahead, spread over the ranks): the slice epilogue's single-GPU kernels (linear
    scales, every row bucket: slice sizes depend on the world), the reduce-scatter kernel, the
    peer algorithm of each format. A key missed here is compiled where it is used."""
    from distnorm import formats
    from distnorm.collectives.rowsplit import linear_spec
    from distnorm.launch.spawn import launch_world_size
    from distnorm.ops import FEW_ROWS, fused_kernel_key
    from allreduce_cases import launched_key, scatter_keys

    world = launch_world_size()
    if world < 2:
        return []
    bf16, H, keys = torch.bfloat16, 4096, []
    if test == "test_seqpar_rows_of_the_issue_bitwise_the_allreduce":
        # the all-reduce each row count's expectations come from (algo auto, y written, its
        # workspace), and every reduce-scatter variant of the row count (gathered or not)
        for quant, opts in QUANTS.values():
            spec = formats.make_quant_spec(quant, **opts)
            for M in (m for m in SEQPAR_ROWS if m > 0):
                keys.append(launched_key(world, "auto", M, H, spec, True, True, False, bf16,
                                         SEQPAR_BUFFER))
                keys += scatter_keys(world, M, H, spec)
        return list(dict.fromkeys(keys))
    if test != "test_nccl_path_bitwise_the_peer_kernels":
        return []
    for k, (quant, opts) in enumerate(QUANTS.values()):
        spec = formats.make_quant_spec(quant, **opts)
        # the no-peer forms' kernels with `world` slots: gather (the call's rows, spec's layout),
        # split (this rank's slice, linear scales, in place)
        keys += [("fused_norm", *fused_kernel_key(bf16, H, s, True, False, True, rows, in_place,
                                                  world))
                 for s, in_place in ((spec, False), (linear_spec(spec), True))
                 for rows in (1, FEW_ROWS, FEW_ROWS + 1)]
        for write_y in (True, False):
            keys += [("fused_norm", *fused_kernel_key(bf16, H, linear_spec(spec), False, False,
                                                      write_y or spec is None, rows))
                     for rows in (1, FEW_ROWS, FEW_ROWS + 1)]
        # the call's own rows: the peer path (32 MiB workspace) and the reduce-scatters (norm_out
        # for the shards, not for gather=True)
        keys += [launched_key(world, algo, M, H, spec, True, True, True, bf16, 32 << 20)
                 for algo in (ALGOS if FULL else (ALGOS[k % len(ALGOS)],)) for M in (1, 130, 2000)]
        keys += [key for M in (1, 130, 2000)
                 for key in scatter_keys(world, M, H, spec, (True, False))]
    return list(dict.fromkeys(keys))


def test_nccl_path_bitwise_the_peer_kernels():
    run_distributed(_body, timeout_s=900)


# uneven shards, 128-row scale tiles crossed; 512: whole tiles per shard at 2 and 4 ranks (swizzled
# scales gathered in place, seqpar's NOTE [gathered scales]; every M with gather_by
# "epilogue-swizzled": NOTE [swizzled scales gathered])
SEQPAR_ROWS = (0, 1, 3, 127, 128, 129, 512, 4099)
SEQPAR_BUFFER = 128 << 20  # the peer workspace of _body_seqpar_rows


@contextlib.contextmanager
def _poisoned_gather_scales():
    """The sequence-parallel op's gathered scales allocated poisoned (0xA5 bytes, NaN floats), so a
    scale the kernel or the gather leaves unwritten shows (a fresh empty tensor often reuses the
    previous call's block, which holds the same values); yields [the number of calls that laid
    scales out after the kernel (seqpar._in_layout)]."""
    from distnorm.collectives import seqpar

    empty, in_layout = seqpar.empty_scales, seqpar._in_layout
    layouts = [0]

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t is not None:
            (t.view(torch.uint8).fill_(0xA5) if t.element_size() == 1 else t.fill_(float("nan")))
        return t

    def counted(*args, **kwargs):
        layouts[0] += 1
        return in_layout(*args, **kwargs)
    seqpar.empty_scales, seqpar._in_layout = poisoned, counted
    try:
        yield layouts
    finally:
        seqpar.empty_scales, seqpar._in_layout = empty, in_layout


def _body_seqpar_rows() -> None:
    """The sequence-parallel op at the row counts its issue names (M = 0, 1, 3, 127, 128, 129,
    4099) and 512 (every format of QUANTS; H = 4096): by the reduce-scatter kernel (peer mappings; rows
    gathered by the row gather kernel and by torch.distributed) and by torch.distributed alone,
    each rank's shard (residual, y, q, scales of its rows), the rows gathered with gather=True
    (y, q and scales in the full-M layout) and by all_gather / all_gather_scales bitwise those of
    allreduce_add_rmsnorm on the same inputs."""
    import dataclasses

    import distnorm
    from distnorm import formats
    from distnorm.collectives.seqpar import _kernel_chunk
    from distnorm.collectives.state import state_of
    from distnorm.comm import resolve_bootstrap
    from quant_check import quant_kwargs

    boot = resolve_bootstrap(None)
    # 128 MiB: one reduce-scatter launch holds all 4099 rows (since the buffer halves, 64 MiB
    # sends the odd M = 4099 to torch.distributed, with a warning, and leaves the kernel untested
    # there: checked below)
    peer = distnorm.Workspace(buffer_bytes=SEQPAR_BUFFER)
    nccl = distnorm.Workspace(backend="none", buffer_bytes=32 << 20)

    def check():
        expect = Expectations()
        with _poisoned_gather_scales() as layouts:
            _check_rows(expect, layouts)
        torch.cuda.synchronize()
        expect.raise_any()

    def _check_rows(expect, layouts):
        H = 4096
        w = (torch.rand(H, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
             + 0.5).to(torch.bfloat16)
        for name, (quant, opts) in QUANTS.items():
            kw = quant_kwargs(quant, opts, "cuda")
            for M in SEQPAR_ROWS:
                g = torch.Generator("cuda").manual_seed(M * 7 + 1000 * peer.rank)
                x = (torch.randn(M, H, device="cuda", generator=g) * 2).to(torch.bfloat16)
                res = torch.randn(M, H, device="cuda", generator=torch.Generator("cuda")
                                  .manual_seed(M + 5)).to(torch.bfloat16)
                want = distnorm.allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=peer,
                                                      norm_out=True, **kw)
                a, b = distnorm.shard_rows(M, peer)
                if M > 0:  # the kernel path, in one launch (NOTE [reduce-scatter chunks])
                    spec = formats.make_quant_spec(quant, **opts)
                    expect(_kernel_chunk(peer, x, spec) >= -(-M // peer.world_size),
                           f"{name} M={M}: the reduce-scatter does not fit one launch")
                for label, ws, gather_by in (("kernel, q in its epilogue", peer, "epilogue"),
                                             ("kernel, swizzled scales in its epilogue", peer,
                                              "epilogue-swizzled"),
                                             ("kernel", peer, "peers"),
                                             ("kernel, NCCL gather", peer, "nccl"),
                                             ("torch.distributed", nccl, "peers")):
                    tag = f"{name} M={M} {label}"
                    state = state_of(ws)
                    state.tuning = dataclasses.replace(state.tuning, gather_by=gather_by)
                    shard = distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6,
                                                                workspace=ws, norm_out=True, **kw)
                    # y, q and scales: the row gather's three segments
                    launches, fused = state.row_gathers, state.epilogue_gathers
                    laid_out = layouts[0]
                    full = distnorm.reduce_scatter_add_rmsnorm(x, res[a:b], w, 1e-6, workspace=ws,
                                                               gather=True, norm_out=True, **kw)
                    by_peers = ws is peer and gather_by != "nccl" and M > 0
                    expect((state.row_gathers > launches) == by_peers,
                           f"{tag}: row gather launched {state.row_gathers - launches} times")
                    # NOTE [gather in the epilogue]: q gathered by the reduce-scatter kernel
                    last_shard = M - (peer.world_size - 1) * -(-M // peer.world_size)
                    in_epilogue = (by_peers and gather_by in GATHERS_IN_EPILOGUE
                                   and quant is not None and last_shard > 0)
                    expect((state.epilogue_gathers > fused) == in_epilogue,
                           f"{tag}: {state.epilogue_gathers - fused} reduce-scatters gathered q")
                    # NOTE [swizzled scales gathered]: the kernel lays them out, or the host after
                    if in_epilogue and quant == "nvfp4":
                        swizzled = gather_by == "epilogue-swizzled"
                        expect((layouts[0] == laid_out) == swizzled,
                               f"{tag}: scales laid out after the kernel {layouts[0] - laid_out} "
                               "times")
                    expect(torch.equal(shard.residual, want.residual[a:b]), tag + " shard h")
                    expect(torch.equal(shard.y, want.y[a:b]), tag + " shard y")
                    expect(torch.equal(full.y, want.y), tag + " gathered y")
                    expect(torch.equal(distnorm.all_gather(shard.y, workspace=ws, rows=M), want.y),
                           tag + " all_gather of the shards' y")
                    if quant is None:
                        continue
                    expect(torch.equal(_bytes(shard.q), _bytes(want.q[a:b])), tag + " shard q")
                    expect(torch.equal(_bytes(full.q), _bytes(want.q)), tag + " gathered q")
                    if quant != "fp8":
                        expect(torch.equal(_bytes(full.scales), _bytes(want.scales)),
                               tag + " gathered scales")
                        scales = distnorm.all_gather_scales(shard.scales, workspace=ws, rows=M,
                                                            hidden=H, quant=quant, **opts)
                        expect(torch.equal(_bytes(scales), _bytes(want.scales)),
                               tag + " all_gather_scales of the shards' scales")
                state_of(peer).tuning = dataclasses.replace(state_of(peer).tuning,
                                                            gather_by="epilogue")

    def graph():
        """gather=True through the peers replays in a CUDA graph (under gloo too: no
        torch.distributed call on the way), new x each replay, bitwise the eager calls."""
        H, M = 4096, 300
        g = torch.Generator("cuda").manual_seed(peer.rank)
        w = torch.rand(H, device="cuda", generator=g).to(torch.bfloat16) + 0.5
        x = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
        a, b = distnorm.shard_rows(M, peer)
        r = torch.randn(b - a, H, device="cuda", generator=g).to(torch.bfloat16)
        gs = torch.tensor([448 * 6 / 12.0], device="cuda")

        def f():
            return distnorm.reduce_scatter_add_rmsnorm(x, r, w, workspace=peer, quant="nvfp4",
                                                       global_scale=gs, gather=True, norm_out=True)
        f()
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            got = f()
        for i in range(3):
            x.copy_(torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16))
            for t in (got.y, got.q, got.scales):
                t.view(torch.uint8).fill_(0xA5)
            cg.replay()
            want = f()
            torch.cuda.synchronize()
            for field in ("residual", "y", "q", "scales"):
                assert torch.equal(_bytes(getattr(got, field)), _bytes(getattr(want, field))), (
                    f"replay {i}: {field} differs from the eager call")
    try:
        gathered_check(boot, check)
        gathered_check(boot, graph)
    finally:
        peer.close()
        nccl.close()


def test_seqpar_rows_of_the_issue_bitwise_the_allreduce():
    run_distributed(_body_seqpar_rows, timeout_s=900)
