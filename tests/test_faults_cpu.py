"""Fault handling on the CPU (distnorm/collectives/faults.py, signature.py): call descriptors,
the messages of recorded errors, and the host barrier's deadline across real processes. The
kernels' side (mismatches detected on the GPU, recovery) is tests/multigpu/test_faults_gpu.py."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from distnorm.collectives import faults
from distnorm.collectives.layout import (CALL_W_HOST_BARRIER, CALL_W_LAST, ERROR_MISMATCH,
                                         ERROR_TIMEOUT, HOST_BARRIER_FIRST_CALL, MIN_SIGNAL_BYTES)
from distnorm.collectives.plan import ALGORITHMS, Tuning
from distnorm.collectives.signature import CallDescriptor, signature, signature_constant
from distnorm.comm.errors import CommMismatchError, CommTimeoutError
from distnorm.formats import NO_QUANT, format_variants, make_quant_spec


def _descriptor(**kw) -> CallDescriptor:
    base = dict(rows=128, hidden=4096, algo="lamport", dtype="bfloat16",
                quant=make_quant_spec("fp8_per_token"), residual=True, norm_out=False,
                allreduce_out=False, gemma=False, world=2)
    base.update(kw)
    return CallDescriptor(**base)


def test_descriptor_words_round_trip_for_every_format_and_algorithm():
    specs = [make_quant_spec(q, **opts) or NO_QUANT for _, q, opts in format_variants()]
    seen = set()
    for spec in specs:
        for algo in ALGORITHMS:
            for dtype in ("bfloat16", "float16"):
                d = _descriptor(quant=spec, algo=algo, dtype=dtype, gemma=dtype == "float16")
                words = d.words()
                assert all(0 <= w < 1 << 31 for w in words)  # never the lamport sentinel (-1)
                assert CallDescriptor.from_words(words) == d
                seen.add(words[1:])
    assert len(seen) == len(specs) * len(ALGORITHMS) * 2  # distinct kernels, distinct words


def test_descriptors_carry_the_form():
    """Ranks in different forms of one algorithm (NOTE [two-shot forms], NOTE [lamport polls])
    would read rows their peers never wrote: the form is in the words, named when it differs, and
    the default form leaves the words (and the kernels' constants) as they were."""
    from distnorm.collectives.plan import ALGORITHM_FORMS
    for algo, forms in ALGORITHM_FORMS.items():
        default = _descriptor(algo=algo)
        assert default.form == forms[0] and default.words() == _descriptor(algo=algo, form=forms[0]).words()
        assert (default.words()[2] >> 9) & 7 == 0
        for form in forms[1:]:
            d = _descriptor(algo=algo, form=form)
            assert CallDescriptor.from_words(d.words()) == d
            assert d.signature() != default.signature()
            assert default.differences(d) == [f"form: {forms[0]} vs {form}"]
            assert f"form={form}" in str(d)
    assert _descriptor(algo="oneshot").form == ""


def test_differences_name_the_fields_and_signatures_differ():
    a, b = _descriptor(), _descriptor(rows=64, quant=make_quant_spec("nvfp4"))
    assert a.differences(b) == ["rows: 128 vs 64", "quant: fp8_per_token vs nvfp4(group_size=16, "
                                "swizzled)"]
    assert a.signature() != b.signature()
    assert a.signature() != _descriptor(rows=129).signature()
    # the kernels compute (rows * K) ^ constant in 32-bit registers; the host agrees on wrap-around
    c = signature_constant(a.words())
    assert signature(1 << 32, c) == signature(0, c) == c
    assert -(1 << 31) <= signature(123456789, c) < 1 << 31
    assert CallDescriptor.from_words([0, 0, 0xFFFF, 0xFFFF]) is None


class _FakeWorkspace:
    """What faults.py reads of a Workspace, over CPU tensors (shared between processes)."""

    def __init__(self, rank, pads, error_flag=None):
        self.rank, self.world_size, self.pads = rank, len(pads), pads
        self.p2p_ok, self.closed = True, False
        self.error_flag = torch.zeros(4, dtype=torch.int32) if error_flag is None else error_flag

    def peer_signal(self, r):
        return self.pads[r]


def _pads(world):
    return [torch.zeros(MIN_SIGNAL_BYTES // 4, dtype=torch.int32).share_memory_()
            for _ in range(world)]


def test_mismatch_message_names_what_differs():
    pads = _pads(2)
    mine, theirs = _descriptor(), _descriptor(rows=7, hidden=8192)
    pads[0][CALL_W_LAST:CALL_W_LAST + 4] = torch.tensor(mine.words(), dtype=torch.int32)
    pads[1][CALL_W_LAST:CALL_W_LAST + 4] = torch.tensor(theirs.words(), dtype=torch.int32)
    ws = _FakeWorkspace(0, pads)
    assert faults.failure(ws) is None
    ws.error_flag[:] = torch.tensor([ERROR_MISMATCH, 1, -1, 0])
    with pytest.raises(CommMismatchError, match=r"rows: 128 vs 7, hidden: 4096 vs 8192") as e:
        faults.raise_if_failed(ws)
    assert e.value.peer == 1 and "reset" in str(e.value) and "rank 1: M=7 H=8192" in str(e.value)
    ws.error_flag[:] = torch.tensor([ERROR_TIMEOUT, 1, 5, 0])
    with pytest.raises(CommTimeoutError, match="The last launches differ") as e:
        faults.raise_if_failed(ws)
    assert not isinstance(e.value, CommMismatchError)


def _barrier_rank(rank, pads, flag, arrive, timeout_s, out):
    ws = _FakeWorkspace(rank, pads, flag)
    if not arrive:
        out.put((rank, "absent", 0.0))
        return
    t0 = time.monotonic()
    try:
        faults.host_barrier(ws, HOST_BARRIER_FIRST_CALL, 1, timeout_s)
        out.put((rank, "ok", time.monotonic() - t0))
    except CommTimeoutError as e:
        out.put((rank, f"timeout: {e}", time.monotonic() - t0))


@pytest.mark.parametrize("absent", [None, 1])
def test_host_barrier_has_a_deadline(absent):
    ctx = mp.get_context("spawn")
    pads = _pads(3)
    flags = [torch.zeros(4, dtype=torch.int32).share_memory_() for _ in range(3)]
    out = ctx.Queue()
    procs = [ctx.Process(target=_barrier_rank, args=(r, pads, flags[r], r != absent, 2.0, out))
             for r in range(3)]
    for p in procs:
        p.start()
    results = {r: (status, t) for r, status, t in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(60)
    for r in range(3):
        status, took = results[r]
        if absent is None:
            assert status == "ok", (r, status)
            assert int(pads[r][CALL_W_HOST_BARRIER + (r + 1) % 3]) == 1
        elif r == absent:
            assert status == "absent"
        else:
            assert status.startswith("timeout") and "rank 1 did not reach" in status, status
            assert 2.0 <= took < 10.0, took
            assert flags[r].tolist()[:3] == [ERROR_TIMEOUT, 1, faults.HOST_BARRIER]


def test_host_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("DISTNORM_HOST_TIMEOUT_S", "3")
    assert Tuning.from_env().host_timeout_s == 3.0
    monkeypatch.setenv("DISTNORM_HOST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DISTNORM_HOST_TIMEOUT_S"):
        Tuning.from_env()
    with pytest.raises(ValueError, match="host_timeout_s"):
        Tuning(host_timeout_s=0)


def test_fault_tests_list_every_kernel_they_launch(monkeypatch):
    """The fault tests' kernels are compiled ahead (their kernel_keys): a rank that compiles one
    inside a test makes its peers' kernels time out (2 s there). At 4 and 8 ranks two-shot's form
    and rows per CTA go by M x H, so the keys must be the planned ones of every call the tests
    make (a cold-cache 4-rank run failed, 2026-11-28, while keys made without M passed warm)."""
    import importlib
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "multigpu"))
    import test_faults_gpu as f
    spawn = importlib.import_module("distnorm.launch.spawn")  # the package's `spawn` is a function

    for world in (2, 4, 8):
        monkeypatch.setattr(spawn, "launch_world_size", lambda w=world: w)
        tuning = f._tuning()
        mismatch = set(f.kernel_keys("test_mismatched_calls_then_recovery", {}))
        leaves = set(f.kernel_keys("test_rank_that_leaves", {}))
        calls = [{}] + [{"M": m} for m in f.GOOD_ROWS]
        for algo in f.ALGOS:
            for kw in calls:
                key = ("allreduce", *f._call_key(world, algo, tuning, **kw))
                assert key in leaves and key in mismatch, (world, algo, kw)
            for field, sides in f.MISMATCHES.items():
                for kw in sides:
                    assert ("allreduce", *f._call_key(world, algo, tuning, **kw)) in mismatch, \
                        (world, algo, field, kw)
    # what the keys without M missed at 4 ranks: two-shot's kernel differs with the size
    assert f._call_key(4, "twoshot", tuning, M=600) != f._call_key(4, "twoshot", tuning)
    assert f._call_key(4, "twoshot", tuning, H=8192) != f._call_key(4, "twoshot", tuning)
    sys.modules.pop("test_faults_gpu", None)
