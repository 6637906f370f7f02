"""The all-reduce kernels (one-shot, two-shot and lamport, world 2/4/8, and the sequence-parallel
reduce-scatter; several output formats and every form) compile for sm_90a and sm_100a from fake
tensors, no GPU needed (CuTe DSL 4.8+ with CUTE_DSL_ARCH set; 4.3.5 stops at a driver check, so
there the test skips and says why). Runs in a subprocess: the DSL reads CUTE_DSL_ARCH once.
"""
from __future__ import annotations

import pytest

from cute_compile import compile_in_subprocess

BODY = """
from distnorm.kernels.compile_allreduce import compiled_allreduce, compiled_rowgather
from ptx_fingerprint import ALLREDUCE, ROWGATHER, allreduce_args
for v in ALLREDUCE:  # the variants the oldest-DSL check compiles too
    compiled_allreduce(*allreduce_args(v))
    done.append(v[:2])
for world, units in ROWGATHER:
    compiled_rowgather(world, units)
    done.append(world)
"""


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_allreduce_kernels_compile(arch):
    compiled = compile_in_subprocess(BODY, arch)  # first: it skips where CuTe DSL is missing
    from ptx_fingerprint import ALLREDUCE, ROWGATHER
    assert compiled == len(ALLREDUCE) + len(ROWGATHER)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("row_sizes", [[4096], [8192, 4, 16384], [2048, 128], [16]])
@pytest.mark.parametrize("buffer_bytes", [32 << 20, 64 << 20, (16 << 20) + 4096 + 48, 1 << 16])
def test_row_gather_chunk_fits_exactly(world, row_sizes, buffer_bytes):
    """The row gather's chunk: every segment's [world][rows] area (16-byte aligned, one after the
    other) fits the part of the buffer before the lamport areas, and one more row would not."""
    from distnorm.collectives.layout import lamport_split, push_half
    from distnorm.collectives.peergather import _chunk_rows, copy_unit
    from distnorm.kernels.rowgather import area_bytes
    general = push_half(lamport_split(buffer_bytes)[0])  # its pushes stay in the lower half
    rows = _chunk_rows(world, row_sizes, buffer_bytes)
    assert sum(area_bytes(world, rows, rb) for rb in row_sizes) <= general
    assert sum(area_bytes(world, rows + 1, rb) for rb in row_sizes) > general
    assert [copy_unit(rb) for rb in row_sizes] == [16 if rb % 16 == 0 else 4 for rb in row_sizes]
    assert copy_unit(90) is None  # MX scales at H = 2880: torch.distributed gathers them


# --- buffer split and capacities (host arithmetic, no GPU) -----------------------------------------
def buffer_elems(algo: str, world: int, m: int, hidden: int, swizzled: bool,
                 gather_acc: bool) -> tuple[int, int]:
    """Elements of T one launch with m rows uses in the data buffer as kernels/allreduce.py lays it
    out, (in the lower half, in the upper half) of the general part (NOTE [push and gather
    halves]; lamport: (in one of its three areas, 0)): an independent model of what
    plan.max_chunk_rows must respect."""
    rows = (m + 127) // 128 * 128 if swizzled else m
    if algo in ("oneshot", "lamport"):
        return world * m * hidden, 0
    s = -(-rows // world)
    return world * s * hidden, world * s * hidden * (1 + (1 if gather_acc else 0))


def fits(algo, world, m, hidden, swz, ga, general, es=2) -> bool:
    """m rows of `algo` fit the general part's halves."""
    from distnorm.collectives.layout import push_half
    lower, upper = buffer_elems(algo, world, m, hidden, swz, ga)
    half = push_half(general)
    return lower * es <= half and upper * es <= general - half


@pytest.mark.parametrize("buffer_bytes", [32 << 20, 64 << 20, (32 << 20) + 12345, 1 << 16])
def test_lamport_split_disjoint_and_aligned(buffer_bytes):
    from distnorm.collectives.layout import LAMPORT_AREAS, lamport_split
    general, area = lamport_split(buffer_bytes)
    assert general % 16 == 0 and area % 16 == 0 and area > 0
    assert general + LAMPORT_AREAS * area <= buffer_bytes


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (128, 4096), (128, 8192), (1000, 7168)])
def test_buffer_for_lamport_holds_one_call(world, rows, hidden):
    """A buffer of buffer_for_lamport(call) takes the call in one lamport launch (the benchmarks
    size their workspace with it; a smaller one chunked 128 x 4096 at 2 ranks into two launches)."""
    from distnorm.collectives.layout import buffer_for_lamport
    from distnorm.collectives.plan import lamport_capacity
    buffer_bytes = buffer_for_lamport(rows * hidden * 2, world)
    assert lamport_capacity(world, hidden, 2, buffer_bytes) >= rows
    assert lamport_capacity(world, hidden, 2, buffer_bytes // 2) < rows


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("hidden", [2048, 4096, 7168, 8192])
@pytest.mark.parametrize("buffer_bytes", [32 << 20, 64 << 20, (16 << 20) + 4096 + 48])
def test_max_chunk_rows_exact(world, hidden, buffer_bytes):
    """Each algorithm's chunk fits its part of the buffer and one more row would not: lamport's in
    ONE of its three areas (not the three together), oneshot / twoshot in the part before them."""
    from distnorm.collectives.layout import lamport_split
    from distnorm.collectives.plan import choose_algo, lamport_capacity, max_chunk_rows, plan_launch
    general, area = lamport_split(buffer_bytes)
    es = 2
    big = 1 << 30
    cap = max_chunk_rows("lamport", world, big, hidden, es, buffer_bytes, False, False)
    assert cap == lamport_capacity(world, hidden, es, buffer_bytes)
    assert buffer_elems("lamport", world, cap, hidden, False, False)[0] * es <= area
    assert buffer_elems("lamport", world, cap + 1, hidden, False, False)[0] * es > area
    for algo in ("oneshot", "twoshot"):
        for ga in (False, True):
            for swz in (False, True):
                try:
                    c = max_chunk_rows(algo, world, big, hidden, es, buffer_bytes, swz, ga)
                except ValueError:  # fewer than 128 rows fit: swizzled chunks cannot be cut
                    assert swz and max_chunk_rows(algo, world, big, hidden, es, buffer_bytes,
                                                  False, ga) < 128 + world
                    continue
                assert fits(algo, world, c, hidden, swz, ga, general)
                if swz:
                    assert c % 128 == 0
                else:  # one more row does not fit (two-shot: within the slices' padding)
                    assert not fits(algo, world, c + world, hidden, False, ga, general)
                    if algo == "oneshot":
                        assert not fits(algo, world, c + 1, hidden, False, ga, general)
    # swizzled: chunks are multiples of 128 rows (or the area is too small and it says so)
    try:
        c = max_chunk_rows("lamport", world, big, hidden, es, buffer_bytes, True, False)
        assert c % 128 == 0 and c <= cap
    except ValueError:
        assert cap < 128
    # auto picks lamport only when one call holds all rows
    m_small = 1
    assert choose_algo("auto", world, m_small, hidden, es, buffer_bytes) == "lamport"
    assert choose_algo("auto", world, cap + 1, hidden, es, buffer_bytes) != "lamport"
    assert choose_algo("lamport", world, cap + 1, hidden, es, buffer_bytes) == "lamport"
    # a chunked swizzled lamport call whose area holds < 128 rows runs one-shot instead, or
    # two-shot when one-shot's part cannot hold 128 rows either
    algo, step = plan_launch("lamport", world, cap + 1, hidden, es, buffer_bytes, True, False, False)
    assert (algo != "lamport") == (cap < 128) and step >= 1
    if algo != "lamport":
        try:
            max_chunk_rows("oneshot", world, cap + 1, hidden, es, buffer_bytes, True, False)
            assert algo == "oneshot"
        except ValueError:
            assert algo == "twoshot"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_auto_never_fails_where_twoshot_fits(world):
    """An algorithm distnorm picked (auto, or one-shot for a chunked swizzled lamport call) that
    cannot hold one chunk gives way to two-shot; an algorithm the caller named still raises."""
    from distnorm.collectives.plan import max_chunk_rows, plan_launch
    for mib in (8, 16, 32, 64):
        for hidden in (4096, 7168, 16384):
            for m in (1, 7, 127, 128, 129, 256, 1000, 4099):
                for swz in (False, True):
                    try:
                        max_chunk_rows("twoshot", world, m, hidden, 2, mib << 20, swz, False)
                    except ValueError:
                        continue
                    algo, step = plan_launch("auto", world, m, hidden, 2, mib << 20, swz, False,
                                             False)
                    assert step >= 1 and (not swz or step >= min(m, 128))
    with pytest.raises(ValueError, match="for oneshot on"):
        plan_launch("oneshot", world, 4099, 16384, 2, 8 << 20, True, False, False)


def test_auto_takes_the_measured_fastest_past_lamport():
    """Where lamport does not apply, one-shot only as far as it beat two-shot
    (ONESHOT_CROSSOVER_BYTES): 128 x 4096 at 4 ranks and 512 x 8192 at 2 ran one-shot (22.2 / 35.6
    us) where two-shot takes 13.8 / 32.1; a workspace too small for lamport gets one-shot for a few
    rows only."""
    from distnorm.collectives.plan import choose_algo
    big, small = 1 << 30, 1 << 20  # lamport holds every call here / almost none
    assert choose_algo("auto", 4, 128, 4096, 2, big) == "twoshot"
    assert choose_algo("auto", 2, 512, 8192, 2, big) == "twoshot"
    assert choose_algo("auto", 2, 512, 4096, 2, big) == "lamport"
    assert choose_algo("auto", 4, 8, 4096, 2, small) == "oneshot"
    assert choose_algo("auto", 4, 32, 4096, 2, small) == "twoshot"
    assert choose_algo("auto", 2, 32, 4096, 2, small) == "oneshot"
    assert choose_algo("auto", 2, 128, 4096, 2, small) == "twoshot"


@pytest.mark.parametrize("table", ["allreduce_fusion_wide_h200_x2", "allreduce_fusion_rows_h200_x4"])
def test_auto_is_the_fastest_algorithm_of_the_latest_table(table):
    """The latest committed full table per world size (each algorithm forced, in one run): at every
    row, for the fused FP8, bf16-norm and plain cases, the algorithm `auto` picks for that call
    (with the run's buffer) is within 3% of the fastest. A crossover table that falls behind the
    kernels fails here (the one-shot table did: 128 x 4096 at 4 ranks, 22.2 us against 13.8)."""
    from committed_tables import committed_table, slower_than_fastest
    from distnorm.collectives.plan import choose_algo
    run = committed_table(table)
    world, buffer_bytes = run["meta"]["world"], run["meta"]["buffer_mib"] << 20
    slow = []
    for row in run["rows"]:
        for kind in ("fp8", "norm", "ar"):
            us = {a: row.get(f"dn_{kind}_{a}") for a in ("lamport", "oneshot", "twoshot")}
            if None in us.values():
                continue
            algo = choose_algo("auto", world, row["M"], row["H"], 2, buffer_bytes,
                               plain=kind == "ar")
            if slower_than_fastest(us, algo):
                slow.append((row["M"], row["H"], kind, algo, us))
    assert not slow, slow


def test_choose_algo_rejects_unknown():
    from distnorm.collectives.plan import ALGOS, choose_algo
    assert ALGOS == ("auto", "lamport", "oneshot", "twoshot")
    with pytest.raises(ValueError, match="algo must be one of"):
        choose_algo("ring", 2, 1, 4096, 2)


def test_planned_calls_are_kept_per_shape(monkeypatch):
    """AllReduceState.planned_call (the eager path's per-shape plan, dispatch.PlannedCall): one
    plan per call shape, M included (algorithm and rows per launch depend on it), equal to
    plan_launch's; the kernel compiled and the grid cap asked once per plan; bounded."""
    import types

    import torch

    from distnorm.collectives import dispatch, state as state_mod
    from distnorm.collectives.plan import plan_launch
    from distnorm.formats import make_quant_spec
    from distnorm.kernels import compile_allreduce

    compiled = []
    monkeypatch.setattr(compile_allreduce, "compiled_allreduce",
                        lambda *key: compiled.append(key) or ("kernel", key))
    monkeypatch.setattr(state_mod.AllReduceState, "grid_cap", lambda self, *a: 264)
    monkeypatch.setattr(state_mod, "MAX_PLANNED_CALLS", 3)
    ws = types.SimpleNamespace(world_size=2, buffer_bytes=32 << 20, device=torch.device("cpu"),
                               _state=state_mod.AllReduceState())
    ws.op_state = lambda name, factory: ws._state
    st = ws._state
    fp8 = make_quant_spec("fp8")
    shape = ("auto", 1, 4096, torch.bfloat16, fp8, True, False, False, False, False)
    first = st.planned_call(ws, *shape)
    assert st.planned_call(ws, *shape) is first and len(compiled) == 1
    assert isinstance(first, dispatch.PlannedCall) and first.scalar == "scale"
    for M in (1, 4096, 100_000):
        call = st.planned_call(ws, "auto", M, 4096, torch.bfloat16, fp8, True, False, False,
                               False, False)
        assert (call.algo, call.step) == plan_launch("auto", 2, M, 4096, 2, 32 << 20, False,
                                                     False, False)
        assert call.kernel[1][0] == call.algo
    assert len(st._calls) <= 3  # M = 100000 made the fourth plan: the cache started over


def test_row_gather_declines_what_it_cannot_gather():
    """gather_by_peers returns False (the caller uses torch.distributed), launching nothing,
    without peer mappings, for CPU tensors, with Tuning.gather_by = "nccl" and for no or more than
    three tensors (rows no copy unit divides: test_row_gather_chunk_fits_exactly's copy_unit)."""
    import types

    import torch

    from distnorm.collectives.peergather import gather_by_peers
    from distnorm.collectives.plan import Tuning
    from distnorm.collectives.state import AllReduceState

    def ws(p2p=True, gather_by="peers"):
        state = AllReduceState(Tuning(gather_by=gather_by))
        return types.SimpleNamespace(p2p_ok=p2p, op_state=lambda name, factory: state,
                                     world_size=2, rank=0, buffer_bytes=64 << 20)

    q = torch.zeros(3, 64, dtype=torch.uint8)
    full = torch.zeros(6, 64, dtype=torch.uint8)
    assert not gather_by_peers(ws(p2p=False), [(q, full)], 5)
    assert not gather_by_peers(ws(), [(q, full)], 5)  # CPU tensors
    assert not gather_by_peers(ws(gather_by="nccl"), [(q, full)], 5)
    assert not gather_by_peers(ws(), [(q, full)] * 4, 5)
    assert not gather_by_peers(ws(), [], 5)
    with pytest.raises(ValueError, match="gather_by"):
        Tuning(gather_by="nvlink")
