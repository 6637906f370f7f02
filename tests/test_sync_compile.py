"""The cross-rank barrier (distnorm.kernels.sync) and its test kernel compile for sm_90a from fake
tensors, no GPU needed (CuTe DSL 4.8+ with CUTE_DSL_ARCH set; 4.3.5 stops at a driver check and the
test skips, saying why). The compile runs in a subprocess: the DSL reads CUTE_DSL_ARCH once."""
from __future__ import annotations

import pytest

from cute_compile import compile_in_subprocess

BODY = """
from barrier_kernel import compiled_barrier_rounds, compiled_primitives_smoke
for world in (2, 4, 8):
    for barrier_only in (False, True):
        compiled_barrier_rounds(world, barrier_only)
        done.append((world, barrier_only))
compiled_primitives_smoke()
done.append("v4")
from push_kernel import MODES, compiled_push  # benchmarks/bench_push.py's measurement kernel
for mode in MODES:
    compiled_push(mode)
    done.append(mode)
"""


def test_barrier_kernels_compile_sm90a():
    assert compile_in_subprocess(BODY, timeout=300) == 10


# NOTE [bulk-copy pushes]: "pipelined-tma" with TMA pushes where a row group fits its stage (world 2
# at H 4096), else exactly pipelined-g2 (world 4 at H 4096, two rows per CTA: 48 KiB a group; H
# 32768: 64 KiB a row): the same PTX but for the form's code in the descriptor constants; and
# "roles-tma" (NOTE [reduce-scatter roles by TMA]) with pusher CTAs where two parts of one (group,
# peer) fit its shared memory, else exactly "serial" (H 32768: a 64 KiB row). `uses`: whether the
# form's own instructions (markers) are in its PTX; where not, the PTX is the fallback's
FALLBACK_BODY = """
import os, tempfile
os.environ["DISTNORM_KEEP_PTX"] = "1"  # the PTX text (--keep-ptx also leaves files in the cwd)
os.chdir(tempfile.mkdtemp())
from distnorm.collectives.signature import CallDescriptor, signature_constant
from distnorm.formats import make_quant_spec
from distnorm.kernels.compile_allreduce import compiled_allreduce
fp8 = make_quant_spec("fp8")
form, fallback = {form!r}, {fallback!r}
for algo, world, H, uses in {cases!r}:
    ptx = {{}}
    for f in (form, fallback):
        ptx[f] = compiled_allreduce(algo, world, "bfloat16", H, fp8, True, False, False, False,
                                    True, 0, f).__ptx__
        words = CallDescriptor(0, H, algo, "bfloat16", fp8, True, False, False, False, world,
                               f).words()
        for value in (words[2], signature_constant(words)):  # the form's code, as immediates
            ptx[f] = ptx[f].replace(str(value), "FORM")
    for marker in {markers!r}:
        assert (marker in ptx[form]) == uses, (world, H)
    for marker in {absent_in_fallback!r}:
        assert marker not in ptx[fallback]
    if not uses:
        assert ptx[form] == ptx[fallback], (world, H)
    done.append((world, H))
"""


def test_tma_form_falls_back_to_thread_stores():
    """NOTE [bulk-copy pushes]: the TMA form's row groups per round (a stage holds the round's rows
    for every peer, two stages within 48 KiB), and where not one group fits the form is
    pipelined-g2 (kernel attributes here, the PTX in a subprocess)."""
    from distnorm.formats import make_quant_spec
    from distnorm.kernels.allreduce import AllReduceAddRMSNormQuant
    from distnorm.kernels.bulkpush import bulk_round_groups, bulk_smem_bytes
    from distnorm.kernels.compile_allreduce import allreduce_tiling, co_resident_ctas_per_sm

    fp8 = make_quant_spec("fp8")
    # (world, H, rows per CTA (0: choose_tiling's), groups per round): 16 KiB a group at world 2
    # and H 4096 (two rows per CTA) leaves one a stage, 8 KiB (one row) two; world 4: three peers;
    # 64-thread CTAs (H 2048, one row) share an SM four ways, so 24 KiB each
    for world, H, rows, want in ((2, 4096, 0, 1), (2, 4096, 1, 2), (2, 2048, 1, 2),
                                 (2, 8192, 0, 1), (4, 1536, 0, 1), (4, 1536, 1, 2),
                                 (4, 2048, 1, 0), (4, 4096, 0, 0), (4, 4096, 1, 0),
                                 (8, 4096, 1, 0), (2, 32768, 0, 0)):
        t = allreduce_tiling(H, fp8, rows)
        per_sm = co_resident_ctas_per_sm(t)
        assert bulk_round_groups(world, H, t.rows_per_cta, per_sm) == want, (world, H, rows)
        if want:  # both stages and what the epilogue takes fit, on every CTA of an SM
            assert (2 * want * (world - 1) * t.rows_per_cta * H * 2 + 1024) * per_sm <= 96 << 10
            assert 2 * want * (world - 1) * t.rows_per_cta * H * 2 + 1024 <= bulk_smem_bytes(per_sm)
        for algo in ("reducescatter", "rsgather"):
            k = AllReduceAddRMSNormQuant(algo, world, t, fp8, True, False, False, False, True,
                                         "bfloat16", "pipelined-tma")
            assert (k.bulk_groups, k.rs_rounds) == (want, -want if want else -2), (world, H, rows)
    assert bulk_round_groups(2, 4100, 1, 2) == 0  # rows of 8200 bytes: not whole 16-byte units
    body = FALLBACK_BODY.format(form="pipelined-tma", fallback="pipelined-g2",
                                cases=[("reducescatter", 2, 4096, True),
                                       ("reducescatter", 4, 4096, False),
                                       ("reducescatter", 2, 32768, False)],
                                markers=["cp.async.bulk"], absent_in_fallback=["cp.async.bulk"])
    assert compile_in_subprocess(body, timeout=300) == 3


def test_roles_form_falls_back_to_serial():
    """NOTE [reduce-scatter roles by TMA]: pusher CTAs where two stages of one (group, peer) part
    fit (within bulkpush's budget per CTA of an SM), else the form is "serial" (a compile-time
    choice from H and the tiling, equal on every rank); kernel attributes here, PTX in a
    subprocess."""
    from distnorm.collectives.layout import MIN_SIGNAL_BYTES, ROLES_FLAG_WORDS
    from distnorm.formats import make_quant_spec
    from distnorm.kernels.allreduce import AllReduceAddRMSNormQuant
    from distnorm.kernels.compile_allreduce import allreduce_tiling, co_resident_ctas_per_sm
    from distnorm.kernels.rolespush import ROLES_PUSHERS, roles_fit

    fp8 = make_quant_spec("fp8")
    # (H, rows per CTA (0: choose_tiling's), fits): 16 KiB parts at H 4096 (two rows) and 8192
    # (one), 64 KiB at 32768; 64-thread CTAs (H 2048, one row) get 24 KiB each
    for H, rows, fits in ((4096, 0, True), (8192, 0, True), (2048, 1, True), (7168, 0, True),
                          (16384, 0, False), (32768, 0, False)):
        t = allreduce_tiling(H, fp8, rows)
        assert roles_fit(H, t.rows_per_cta, co_resident_ctas_per_sm(t)) == fits, (H, rows)
        for world in (2, 4, 8):  # a part is one peer's: the same at every world size
            for algo in ("reducescatter", "rsgather"):
                k = AllReduceAddRMSNormQuant(algo, world, t, fp8, True, False, False, False, True,
                                             "bfloat16", "roles-tma")
                assert (k.roles_pushers, k.rs_rounds, k.bulk_groups) == \
                    (ROLES_PUSHERS if fits else 0, 1, 0), (H, world, algo)
    assert MIN_SIGNAL_BYTES <= 1 << 20 and ROLES_FLAG_WORDS > 8 * 2 * 1024
    body = FALLBACK_BODY.format(form="roles-tma", fallback="serial",
                                cases=[("reducescatter", 2, 4096, True),
                                       ("rsgather", 2, 32768, False),
                                       ("reducescatter", 4, 32768, False)],
                                markers=["cp.async.bulk", "red.release.sys"],
                                absent_in_fallback=[])
    assert compile_in_subprocess(body, timeout=300) == 3


def test_region_layout_and_timeout(monkeypatch):
    from distnorm.collectives import layout
    from distnorm.collectives.plan import Tuning

    assert layout.REGION_WORDS == layout.MAX_CTAS * (1 + layout.MAX_WORLD * layout.FLAG_SLOTS
                                                     * layout.FLAG_WORDS)
    assert layout.MIN_SIGNAL_BYTES <= 1 << 20  # the Workspace's default signal_bytes
    assert layout.region_word(2) == 2 * layout.REGION_WORDS
    assert layout.DEVICE_ERROR_WORD == layout.region_word(layout.REGION_DEVICE_ERROR)
    regions = [layout.REGION_BARRIER_TEST, layout.REGION_ONESHOT, layout.REGION_TWOSHOT,
               layout.REGION_LAMPORT, layout.REGION_DEVICE_ERROR]
    assert sorted(set(regions)) == regions  # one region each, in order
    layout.check_signal_pad(layout.MIN_SIGNAL_BYTES, 8, 1024)
    with pytest.raises(ValueError, match="signal pad"):
        layout.check_signal_pad(layout.MIN_SIGNAL_BYTES - 4, 2)
    with pytest.raises(ValueError, match="at most 8 ranks"):
        layout.check_signal_pad(1 << 20, 9)
    monkeypatch.delenv("DISTNORM_BARRIER_TIMEOUT_S", raising=False)
    monkeypatch.delenv("DISTNORM_PDL", raising=False)
    assert Tuning.from_env() == Tuning() and Tuning().timeout_ns == 10_000_000_000
    monkeypatch.setenv("DISTNORM_BARRIER_TIMEOUT_S", "2.5")
    monkeypatch.setenv("DISTNORM_PDL", "0")
    assert Tuning.from_env().timeout_ns == 2_500_000_000 and not Tuning.from_env().pdl
    assert Tuning(timeout_s=1).timeout_ns == 1_000_000_000
    with pytest.raises(ValueError, match="timeout_s"):
        Tuning(timeout_s=0)
    monkeypatch.setenv("DISTNORM_BARRIER_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DISTNORM_BARRIER_TIMEOUT_S"):
        Tuning.from_env()


def test_algorithm_form_tuning(monkeypatch):
    """The two-shot and lamport forms are Tuning knobs (NOTE [two-shot forms], NOTE [lamport
    polls]): checked, read from the environment, part of their algorithm's kernel key only, and a
    new Tuning on a workspace's state drops the calls planned (and the kernels picked) under the
    old one."""
    import dataclasses

    import torch

    from distnorm.collectives.dispatch import allreduce_kernel_key
    from distnorm.collectives.plan import (LAMPORT_FORMS, REDUCESCATTER_FORMS, ROWGATHER_FORMS,
                                           SIZED_FORMS, TWOSHOT_FORMS, Tuning)
    from distnorm.collectives.state import AllReduceState

    monkeypatch.delenv("DISTNORM_TWOSHOT_FORM", raising=False)
    monkeypatch.delenv("DISTNORM_LAMPORT_FORM", raising=False)
    assert Tuning.from_env().twoshot_form == "auto" and TWOSHOT_FORMS[0] == "push"
    assert Tuning.from_env().lamport_form == "poll-all" == LAMPORT_FORMS[0]
    monkeypatch.setenv("DISTNORM_LAMPORT_FORM", "poll-unseen")
    assert Tuning.from_env().form("lamport") == "poll-unseen"
    with pytest.raises(ValueError, match="lamport_form must be one of"):
        Tuning(lamport_form="push")
    monkeypatch.setenv("DISTNORM_TWOSHOT_FORM", "pull")
    assert Tuning.from_env().twoshot_form == "pull"
    monkeypatch.setenv("DISTNORM_TWOSHOT_FORM", "sideways")
    with pytest.raises(ValueError, match="DISTNORM_TWOSHOT_FORM='sideways': expected one of auto, push"):
        Tuning.from_env()
    monkeypatch.setenv("DISTNORM_TWOSHOT_FORM", "pull")
    with pytest.raises(ValueError, match="twoshot_form must be one of"):
        Tuning(twoshot_form="sideways")
    monkeypatch.delenv("DISTNORM_REDUCESCATTER_FORM", raising=False)
    monkeypatch.delenv("DISTNORM_ROWGATHER_FORM", raising=False)
    monkeypatch.delenv("DISTNORM_TWOSHOT_FORM", raising=False)
    auto = Tuning.from_env()
    assert auto.reducescatter_form == auto.rowgather_form == "auto"
    # NOTE [sized forms]: the second kernel form from the threshold's bytes on, the first below
    for algo, forms in (("reducescatter", REDUCESCATTER_FORMS), ("rowgather", ROWGATHER_FORMS)):
        threshold = SIZED_FORMS[algo][0][1][0]
        for world in (2, 4, 8):  # the same rule for every world size
            assert auto.form(algo, threshold - 1, world) == forms[0] == auto.form(algo)
            assert auto.form(algo, threshold, world) == forms[1] == auto.form(algo, 1 << 40)
    assert SIZED_FORMS["reducescatter"][0][1][0] == 32 << 20
    assert SIZED_FORMS["rowgather"][0][1][0] == 8 << 20
    # the epilogue-gathering reduce-scatter: its own ladder (2 ranks: pipelined from 64 MiB,
    # pipelined-8 from 128 MiB; 4 and 8: pipelined from 128 MiB), the reduce-scatter's knob when
    # forced
    assert auto.form("rsgather", (64 << 20) - 1, 2) == "serial"
    assert auto.form("rsgather", 64 << 20, 2) == "pipelined"
    assert auto.form("rsgather", 128 << 20, 2) == "pipelined-8"
    for world in (4, 8):
        assert auto.form("rsgather", (128 << 20) - 1, world) == "serial"
        assert auto.form("rsgather", 128 << 20, world) == auto.form("rsgather", 1 << 40, world) \
            == "pipelined"
    assert Tuning(reducescatter_form="pipelined").form("rsgather", 0) == "pipelined"
    assert Tuning(reducescatter_form="pipelined-8").form("rsgather", 0) == "pipelined-8"
    # every form has its rounds in the kernel (NOTE [reduce-scatter rounds])
    from distnorm.kernels.reducescatter import RS_FORM_ROUNDS
    assert tuple(RS_FORM_ROUNDS) == REDUCESCATTER_FORMS
    assert [RS_FORM_ROUNDS[f] for f in REDUCESCATTER_FORMS] == [1, 4, 8, 16, 32, 2, -2, -4, -2, 1]
    # NOTE [bulk-copy pushes], [reduce-scatter roles by TMA]: the TMA forms are in no ladder,
    # reached only when forced
    for tma_form in ("pipelined-tma", "roles-tma"):
        assert all(form != tma_form for table in SIZED_FORMS.values()
                   for ladder in table.values() for _, form in ladder)
        assert Tuning(reducescatter_form=tma_form).form("rsgather", 0) == tma_form
    # packed FP4 has its own ladder by world size (the kernel key picks it)
    from distnorm.formats import make_quant_spec
    sizes = (8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20, 256 << 20)
    for quant, world, want in (("nvfp4", 2, ["serial", "pipelined-g4", "pipelined-g2",
                                             "pipelined-8", "pipelined-16", "pipelined-32"]),
                               ("nvfp4", 4, ["pipelined", "serial", "serial", "serial",
                                             "pipelined", "pipelined"]),
                               ("nvfp4", 8, ["pipelined", "serial", "serial", "serial",
                                             "pipelined", "pipelined"]),
                               ("fp8", 4, ["serial"] * 4 + ["pipelined"] * 2),
                               ("fp8", 2, ["serial"] * 3 + ["pipelined", "pipelined-8",
                                                           "pipelined-8"])):
        spec = make_quant_spec(quant)
        keys = [allreduce_kernel_key("rsgather", world, torch.bfloat16, 8192, spec, True, False,
                                     False, False, auto, n) for n in sizes]
        assert [k[-1] for k in keys] == want, (quant, world)
    # two-shot by world size: push at 2 ranks below 64 MiB, push-rounds beyond; at 4 and 8 (3: the
    # next larger entry, 4; 16: the largest, 8) push-wide below 16 MiB, pull below 32 MiB, push below 64 MiB, push-rounds beyond
    assert [auto.form("twoshot", n, 2) for n in (0, 32 << 20, (64 << 20) - 1, 64 << 20, 1 << 40)] == \
        ["push", "push", "push", "push-rounds", "push-rounds"]
    rungs = ((0, "push-wide"), ((16 << 20) - 1, "push-wide"), (16 << 20, "pull"),
             ((32 << 20) - 1, "pull"), (32 << 20, "push"), ((64 << 20) - 1, "push"),
             (64 << 20, "push-rounds"), (1 << 40, "push-rounds"))
    for world in (3, 4, 8, 16):
        assert [auto.form("twoshot", nbytes, world) for nbytes, _ in rungs] == [f for _, f in rungs]
    assert allreduce_kernel_key("twoshot", 4, torch.bfloat16, 4096, None, True, False, True,
                                False, auto, 2048 * 4096 * 2)[-1] == "pull"
    # rows per CTA by size where Tuning leaves them at 0 (NOTE [sized rows per CTA]): at 4 and 8
    # ranks one below 2 MiB and from 16 to 32 MiB, choose_tiling's (0) elsewhere and at 2 ranks; a
    # set value wins
    from distnorm.collectives.dispatch import ROWS_PER_CTA_ARG
    sizes = (0, (2 << 20) - 1, 2 << 20, (16 << 20) - 1, 16 << 20, (32 << 20) - 1, 32 << 20, 1 << 40)
    for world in (3, 4, 8, 16):
        assert [auto.rows("twoshot", n, world) for n in sizes] == [1, 1, 0, 0, 1, 1, 0, 0]
    assert [auto.rows("twoshot", n, 2) for n in (0, 1 << 40)] == [0, 0]
    assert auto.rows("rsgather", 0, 4) == 0 and auto.rows("lamport", 0, 4) == 1
    assert Tuning(rows_per_cta={"twoshot": 2}).rows("twoshot", 0, 4) == 2
    keys = [allreduce_kernel_key("twoshot", 4, torch.bfloat16, 4096, None, True, False, True,
                                 False, auto, m * 4096 * 2) for m in (128, 256)]
    assert [k[ROWS_PER_CTA_ARG] for k in keys] == [1, 0]
    assert allreduce_kernel_key("twoshot", 2, torch.bfloat16, 4096, None, True, False, True,
                                False, auto, 512 * 4096 * 2)[-1] == "push"
    assert allreduce_kernel_key("reducescatter", 2, torch.bfloat16, 4096, None, True, False, True,
                                False, auto, 4099 * 4096 * 2)[-1] == "pipelined"
    monkeypatch.setenv("DISTNORM_REDUCESCATTER_FORM", "serial")
    assert Tuning.from_env().form("reducescatter", 1 << 40) == "serial"  # forced: every size
    monkeypatch.setenv("DISTNORM_REDUCESCATTER_FORM", "pipelined")
    assert Tuning.from_env().form("reducescatter") == "pipelined"
    with pytest.raises(ValueError, match="lamport_form must be one of"):
        Tuning(lamport_form="auto")  # sized forms only where they were measured
    with pytest.raises(ValueError, match="reducescatter_form must be one of"):
        Tuning(reducescatter_form="push")
    pull = Tuning(twoshot_form="pull-gather", lamport_form="poll-unseen",
                  reducescatter_form="pipelined")
    for algo, form in (("twoshot", "pull-gather"), ("lamport", "poll-unseen"), ("oneshot", ""),
                       ("reducescatter", "pipelined")):  # one-shot has one form
        assert allreduce_kernel_key(algo, 4, torch.bfloat16, 4096, None, True, False, True, True,
                                    pull)[-1] == form
    capped = Tuning(max_ctas={"twoshot": 24})
    assert capped.ctas("twoshot", 132) == 24 and capped.ctas("twoshot", 16) == 16
    assert capped.ctas("lamport", 132) == 132  # uncapped: every co-resident CTA
    # NOTE [world CTA caps]: lamport at 4 ranks takes at most 64 unless max_ctas names it
    assert Tuning().ctas("lamport", 132, 4) == 64 and Tuning().ctas("lamport", 32, 4) == 32
    assert Tuning().ctas("lamport", 132, 2) == Tuning().ctas("twoshot", 132, 4) == 132
    assert Tuning(max_ctas={"lamport": 0}).ctas("lamport", 132, 4) == 132
    assert Tuning(max_ctas={"lamport": 100}).ctas("lamport", 132, 4) == 100
    state = AllReduceState(Tuning())
    state._calls["planned"] = object()
    state._grid_caps["cap"] = 1
    state.tuning = dataclasses.replace(state.tuning, twoshot_form="pull")
    assert state.tuning.twoshot_form == "pull" and not state._calls and not state._grid_caps


@pytest.mark.parametrize("table", ["seqpar_forms_swz_h200_x2", "seqpar_table_h200_x4"])
def test_gathered_forms_are_the_fastest_of_the_latest_table(table, monkeypatch):
    """The latest committed sequence-parallel table per world size (the gathering reduce-scatter
    forced into each form the table has, static FP8 and NVFP4): the form `auto` picks for each row
    (the kernel key's, by format and bytes: NOTE [sized forms]) is within 3% of the fastest (a
    form the table lacks fails the test)."""
    import os

    import torch
    from committed_tables import RESULTS, committed_table, slower_than_fastest
    monkeypatch.syspath_prepend(os.path.dirname(RESULTS))  # benchmarks/
    from bench_seqpar import RS_FORM_TAGS

    from distnorm.collectives.dispatch import allreduce_kernel_key
    from distnorm.collectives.plan import Tuning
    from distnorm.formats import make_quant_spec
    run = committed_table(table)
    auto = Tuning(reducescatter_form="auto", rowgather_form="auto")
    slow = []
    for row in run["rows"]:
        for fmt, quant in (("fp8", "fp8"), ("nvfp4", "nvfp4")):
            us = {form: row[f"dn_rs_{fmt}_gather_{tag}"] for form, tag in RS_FORM_TAGS.items()
                  if row.get(f"dn_rs_{fmt}_gather_{tag}") is not None}
            form = allreduce_kernel_key("rsgather", run["meta"]["world"], torch.bfloat16, row["H"],
                                        make_quant_spec(quant), True, False, False, False, auto,
                                        row["M"] * row["H"] * 2)[-1]
            if slower_than_fastest(us, form):
                slow.append((row["M"], row["H"], fmt, form, us))
    assert not slow, slow
