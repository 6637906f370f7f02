"""CPU tests of the test suite's own setup: splitting tests over launched ranks (tests/sharding.py,
conftest.py), and the grid levels of the single-GPU tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from distnorm.launch import LaunchEnv, detect_launch_env, without_launcher_vars
from sharding import group_owners, plan_shard, sharding_enabled
from test_single_gpu import (EDGE_HIDDEN, EDGE_TOKENS, MIDDLE_HIDDEN, MODEL_CASES, PACKED_CASES,
                             RAGGED_CASES, SLOTS_CASES, SPLIT_CASES, TOKENS, VARIANTS,
                             fused_norm_cases, grid_level)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- sharding arithmetic ------------------------------------------------------------------------
def test_groups_go_round_robin_in_order_of_first_appearance():
    assert group_owners(["a", "a", "b", "c", "b", "d", "a"], 2) == [0, 0, 1, 0, 1, 1, 0]
    assert group_owners(["a", "b", "c"], 1) == [0, 0, 0]
    assert group_owners([], 4) == []


@pytest.mark.parametrize("world", [0, -1, 1.0, True])
def test_group_owners_rejects_bad_world_size(world):
    with pytest.raises(ValueError, match="world_size"):
        group_owners(["a"], world)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_per_process_item_runs_once_and_collective_items_everywhere(world):
    keys = [None, None] + [("k", i // 3) for i in range(20)] + [f"solo{i}" for i in range(5)] + [None]
    plans = [plan_shard(keys, rank, world) for rank in range(world)]
    mine = [i for plan in plans for i in plan.mine]
    per_process = [i for i, key in enumerate(keys) if key is not None]
    assert sorted(mine) == per_process  # disjoint, and together everything
    for plan in plans:
        assert plan.order[:3] == [0, 1, 27]  # collective first, in collection order
        owners = {keys[i] for i in plan.mine}
        other = {keys[i] for p in plans if p is not plan for i in p.mine}
        assert not owners & other, "a group was split over ranks"
        assert plan.per_process_total == 25 and plan.groups_total == 12
    sizes = [len(plan.mine) for plan in plans]
    assert max(sizes) - min(sizes) <= 3 + 1  # groups of <= 3 items, dealt round robin


def test_plan_summary_says_what_ran():
    plan = plan_shard([None, "a", "b", "b"], 1, 2)
    assert plan.mine == (2, 3)
    assert plan.summary().startswith("rank 1 of 2 ran 2 of 3 per-process tests")
    assert "1 multi-GPU tests (on every rank)" in plan.summary()
    with pytest.raises(ValueError, match="rank must be in"):
        plan_shard(["a"], 2, 2)


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_sharding_switch(value, expected):
    assert sharding_enabled({} if value is None else {"DISTNORM_SHARD": value}) is expected


def test_sharding_switch_rejects_other_values():
    with pytest.raises(ValueError, match="DISTNORM_SHARD must be 0 or 1, got 'yes'"):
        sharding_enabled({"DISTNORM_SHARD": "yes"})


# --- the single-GPU grid ------------------------------------------------------------------------
def test_grid_levels_from_the_environment():
    assert grid_level({}) == "default"
    assert grid_level({"DISTNORM_QUICK": "1"}) == "quick"
    assert grid_level({"DISTNORM_FULL": "1"}) == "full"
    with pytest.raises(ValueError, match="DISTNORM_QUICK=1 and DISTNORM_FULL=1"):
        grid_level({"DISTNORM_QUICK": "1", "DISTNORM_FULL": "1"})
    with pytest.raises(ValueError, match="level must be"):
        fused_norm_cases("huge")


def test_default_grid_covers_every_format_dtype_and_edge():
    cases = fused_norm_cases("default")
    assert len(cases) == len(set(cases)) == len(VARIANTS) * 2 * 2 * len(TOKENS)
    for variant in VARIANTS:
        for dtype in ("bf16", "fp16"):
            mine = [c for c in cases if c[:2] == (variant, dtype)]
            assert {m for *_, m in mine} == set(TOKENS)
            assert len({h for _, _, h, _ in mine}) == 2  # two kernels to compile per pair
        # each variant meets both edge hidden sizes with the edge row counts
        for h in EDGE_HIDDEN:
            assert {m for v, _, hh, m in cases if v == variant and hh == h} >= set(EDGE_TOKENS)
    assert {h for _, _, h, _ in cases} == set(EDGE_HIDDEN + MIDDLE_HIDDEN)


def test_grid_levels_nest():
    quick, default, full = (set(fused_norm_cases(level)) for level in ("quick", "default", "full"))
    assert quick < default < full
    assert len(full) == len(VARIANTS) * 2 * 7 * 5
    assert {(v, d) for v, d, *_ in quick} == {(v, d) for v in VARIANTS for d in ("bf16", "fp16")}


def test_batch_invariance_covers_every_scale_kind_and_group_size():
    from test_single_gpu import (CLUSTER_HIDDEN, _invariance_key, fused_norm_cases,
                                 invariance_cases)
    full = invariance_cases("full")
    assert all(sorted(v for v, _, _ in cases) == sorted(VARIANTS) for cases in full.values())
    default = invariance_cases("default")
    assert sorted(v for v, _, h in default["no_cluster"]) == sorted(VARIANTS)
    assert all(h < CLUSTER_HIDDEN[0] for _, _, h in default["no_cluster"])
    assert len({h for _, _, h in default["no_cluster"]}) >= 3  # several sizes, not one
    for h in CLUSTER_HIDDEN:
        cases = default[str(h)]
        assert {hh for _, _, hh in cases} == {h} and len(cases) < len(VARIANTS)
        assert {_invariance_key(v) for v, _, _ in cases} == {_invariance_key(v) for v in VARIANTS}
    # reuse: most checks run a (variant, dtype, H) that the default grid compiles anyway
    in_grid = {(v, d, h) for v, d, h, _ in fused_norm_cases("default")}
    checks = [c for cases in default.values() for c in cases]
    assert sum(c in in_grid for c in checks) >= len(checks) - 4, \
        [c for c in checks if c not in in_grid]


# --- conftest under a (faked) launcher: collection only, no process group --------------------------
def _run_all(jobs):
    """Run pytest as (rank, world, args, shard) of a faked job, for each job at once (each pays
    torch's import and a collection: several seconds on a GPU machine), and return the finished
    processes in order."""
    procs = [_start_as(*job) for job in jobs]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()  # none left behind when one timed out (no-op for the finished)
    return done


def _start_as(rank: int, world: int, args, shard: str | None):
    env = without_launcher_vars(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world)})
    env.pop("DISTNORM_QUICK", None)
    env.pop("DISTNORM_FULL", None)
    # a faked job has no rendezvous: keep its GPUs hidden, so a multi-GPU test skips for want of
    # GPUs (on a GPU machine it would try to join the faked job and fail)
    env["CUDA_VISIBLE_DEVICES"] = ""
    if shard is not None:
        env["DISTNORM_SHARD"] = shard
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _collected(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_launched_ranks_split_the_grid_by_kernel():
    files = ["tests/test_single_gpu.py", "tests/multigpu/test_barrier_gpu.py", "--collect-only"]
    *ranks, unsplit = _run_all([(0, 2, files, None), (1, 2, files, None), (0, 2, files, "0")])
    for proc in ranks:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = [_collected(proc) for proc in ranks]
    everything = _collected(unsplit)
    barrier = [n for n in everything if "multigpu" in n]
    # + 10: test_single_gpu.py's other tests (3 batch-invariance, 3 strided, graph, 2 dependent
    # chains, bad inputs), and the split-rows, ragged-rows, one-CTA-per-SM and slots cases
    assert len(barrier) == 3 and len(everything) == (3 + len(fused_norm_cases("default")) + 10
                                                     + len(SPLIT_CASES) + len(RAGGED_CASES)
                                                     + len(MODEL_CASES) + len(PACKED_CASES)
                                                     + len(SLOTS_CASES))
    for names in got:
        assert names[:3] == barrier  # collective tests first, on every rank
    per_rank = [set(names[3:]) for names in got]
    assert not per_rank[0] & per_rank[1] and per_rank[0] | per_rank[1] == set(everything) - set(barrier)

    def kernels(names):
        return {re.sub(r"-\d+\]$", "]", n) for n in names if "test_fused_norm" in n}
    assert not kernels(per_rank[0]) & kernels(per_rank[1]), "a kernel's cases were split"
    deselected = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", ranks[0].stdout)
    assert deselected and int(deselected.group(3)) == len(per_rank[1])


def test_keyword_selection_comes_before_the_split():
    """`mpirun -np 2 pytest -k ...` selecting one test: the split is of what -k selected, so
    rank 1's share is empty and it passes (split first, -k left rank 1 with no tests: exit 5,
    and mpirun failed the job)."""
    test = ("tests/test_launch.py", "-k", "test_single_process_default")
    _assert_rank_1_ran_nothing_and_rank_0_passed(test)


def _assert_rank_1_ran_nothing_and_rank_0_passed(test) -> None:
    proc1, proc0 = _run_all([(1, 2, test, None), (0, 2, test, None)])
    assert proc1.returncode == 0, proc1.stdout[-2000:]
    assert "rank 1 of 2 ran 0 of 1 per-process tests" in proc1.stdout
    assert proc0.returncode == 0 and "1 passed" in proc0.stdout, proc0.stdout[-2000:]


def test_a_rank_with_an_empty_share_passes():
    _assert_rank_1_ran_nothing_and_rank_0_passed(("tests/test_launch.py::test_single_process_default",))


def test_per_process_tests_see_no_launcher_variables():
    """Under a launcher (see the next test), a per-process test sees a plain process."""
    assert detect_launch_env() == LaunchEnv(0, 0, 1, 1, "single")
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


def test_launcher_variables_are_hidden_from_per_process_tests_only():
    inner = "tests/test_suite_setup.py::test_per_process_tests_see_no_launcher_variables"
    proc, multigpu = _run_all([(1, 2, (inner,), "0"),
                               (1, 2, ("tests/multigpu/test_barrier_gpu.py", "-rs"), None)])
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]
    # a multi-GPU test still sees the job (here it skips for want of GPUs, saying so)
    assert multigpu.returncode == 0 and "torchrun started 2 ranks on this node" in multigpu.stdout, \
        multigpu.stdout[-2000:]


def test_compile_tally_adds_compile_seconds_to_the_running_test():
    import logging

    from compile_tally import CompileTally

    tally = CompileTally()
    log = logging.getLogger("distnorm.compile.test_tally")
    log.addHandler(tally)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        tally.current = "t::a"
        log.debug("compiled k in 1.50 s", extra={"compile_s": 1.5})
        log.debug("compiled k in 0.50 s", extra={"compile_s": 0.5})
        log.debug("a record without seconds")
        tally.current = "t::b"
        log.debug("compiled k in 3.00 s", extra={"compile_s": 3.0})
    finally:
        log.removeHandler(tally)
    lines = tally.summary()
    assert lines[0].startswith("distnorm compile time: 3 kernels in 5.0 s")
    assert "t::b" in lines[1] and "3.0 s" in lines[1] and "t::a" in lines[2] and "2 kernels" in lines[2]
    assert CompileTally().summary() == []


def test_reducescatter_forms_under_test_from_the_environment(monkeypatch):
    """The GPU tests' reduce-scatter forms: the unverified ones only on request, DISTNORM_RS_FORMS
    keeps the named ones in their order of REDUCESCATTER_FORMS, an unknown name is an error."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "multigpu"))
    from allreduce_cases import UNVERIFIED_RS_FORMS, rs_forms_under_test
    from distnorm.collectives.plan import REDUCESCATTER_FORMS

    monkeypatch.delenv("DISTNORM_UNVERIFIED_FORMS", raising=False)
    monkeypatch.delenv("DISTNORM_RS_FORMS", raising=False)
    default = rs_forms_under_test()
    assert default[0] == "serial" and not set(default) & set(UNVERIFIED_RS_FORMS)
    monkeypatch.setenv("DISTNORM_UNVERIFIED_FORMS", "1")
    assert rs_forms_under_test() == REDUCESCATTER_FORMS
    monkeypatch.setenv("DISTNORM_RS_FORMS", "roles-tma, serial")
    assert rs_forms_under_test() == ("serial", "roles-tma")
    monkeypatch.delenv("DISTNORM_UNVERIFIED_FORMS")
    assert rs_forms_under_test() == ("serial",)  # still gated
    monkeypatch.setenv("DISTNORM_RS_FORMS", "serial,pipelined-99")
    with pytest.raises(ValueError, match="DISTNORM_RS_FORMS.*pipelined-99"):
        rs_forms_under_test()
