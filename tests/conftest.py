"""Shared pytest setup: import distnorm from this checkout; keep NVLink multicast off everywhere;
run the suite under any launcher (docs/TESTING.md).

Multi-GPU tests (tests/multigpu) run their bodies through distnorm.launch.run_distributed: directly
on each rank under torchrun / mpirun, else in one self-spawned process per visible GPU.

Under a launcher with N > 1 ranks (tests/sharding.py): every rank uses its own GPU (local rank),
the multi-GPU tests run first on every rank, and the other tests are split over the ranks
(DISTNORM_SHARD=0: every rank runs all of them) and see the environment of a plain process (no
launcher variables). At the end every rank leaves torch.distributed together
(distnorm.launch.shutdown).
"""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _path in (_TESTS, _ROOT):  # tests/: helper modules (barrier_kernel, harness, ...) import by name
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pytest  # noqa: E402

from distnorm.launch.env import (apply_no_multicast_env, detect_launch_env,  # noqa: E402
                                 without_launcher_vars)
from compile_tally import CompileTally  # noqa: E402
from sharding import ShardPlan, plan_shard, sharding_enabled  # noqa: E402

apply_no_multicast_env()


def _speed_up_inductor_in_tests() -> None:
    """Settings for the processes of this test run (the ranks tests spawn inherit them).

    Profiled on an H200 machine (test_fusion_cpu's two ranks, 82 s): Inductor's first compile in
    each process checks the CPU's vector ISA by building a probe and loading it in a fresh
    `python -c "import torch ..."` per candidate ISA (11 such runs, 44 s); TORCHINDUCTOR_VEC_ISA_OK=1
    trusts the CPU's flags instead (a compiler without that ISA then fails the compile loudly).
    And importing torch._inductor took 15 s on every run there, a second import as long as the
    first: Python could not keep the compiled bytecode (bytecode writes off or a read-only
    site-packages), so where it cannot, the bytecode goes to a cache of this user's under the
    temporary directory."""
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    import importlib.util
    import tempfile

    import torch

    pyc = importlib.util.cache_from_source(
        os.path.join(os.path.dirname(torch.__file__), "_inductor", "compile_fx.py"))
    if os.path.exists(pyc) or (not sys.dont_write_bytecode
                               and os.access(os.path.dirname(os.path.dirname(pyc)), os.W_OK)):
        return
    prefix = os.path.join(tempfile.gettempdir(), f"distnorm-tests-pycache-{os.getuid()}")
    os.environ.setdefault("PYTHONPYCACHEPREFIX", prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False


def _undo_mpirun_core_binding() -> None:
    """Open MPI binds each rank to one core by default when it starts 1 or 2 ranks (to a socket
    above that), and every process a test then starts (spawned ranks, Inductor's compiler runs)
    inherits that one core: `mpirun -np 1 python -m pytest tests` on an H200 machine had run half
    the suite at 500 s, where plain pytest finishes it in 330 s. The tests' processes may use every
    CPU this process is allowed (the kernel keeps a container's cpuset); `mpirun --bind-to none`
    does the same from outside."""
    if not hasattr(os, "sched_setaffinity") or "OMPI_COMM_WORLD_RANK" not in os.environ:
        return
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # no CPU outside the binding is allowed here: keep it
        pass


_undo_mpirun_core_binding()  # first: before torch sizes its thread pool from the affinity
_speed_up_inductor_in_tests()

_PLAN = pytest.StashKey[ShardPlan]()
_TALLY = pytest.StashKey[CompileTally]()


class _FailuresNamedAtOnce:
    """Under a launcher, names a failing test on stderr when it fails, not only in the summary:
    the ranks' progress characters interleave, and a run that a time limit kills never prints the
    summary (2026-11-28, 4 ranks on a cold kernel cache: nine F's and no names). The rank is
    taken at configure time: a per-process test runs without the launcher's variables."""

    def __init__(self, rank: int):
        self.rank = rank

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            sys.stderr.write(f"\ndistnorm: rank {self.rank}: FAILED {report.nodeid} "
                             f"({report.when}, {report.duration:.1f} s)\n")
            sys.stderr.flush()


def pytest_configure(config: pytest.Config) -> None:
    import logging

    tally = config.stash[_TALLY] = CompileTally()
    compile_log = logging.getLogger("distnorm.compile")
    compile_log.addHandler(tally)
    compile_log.setLevel(logging.DEBUG)
    env = detect_launch_env()
    if not env.is_multiprocess:
        return
    config.pluginmanager.register(_FailuresNamedAtOnce(env.rank), "distnorm-failures-named")
    import torch

    if torch.cuda.is_available():  # single-GPU tests use "cuda", the current device: this rank's own
        from distnorm.launch import local_device_index

        torch.cuda.set_device(local_device_index(env))


@pytest.fixture(autouse=True)
def _per_process_tests_run_as_plain_processes(request: pytest.FixtureRequest,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a launcher, a test that is not collective sees no launcher variables: it runs on one
    rank of the split, so it must not behave as a rank of the job (e.g. code that asks
    detect_launch_env() whether to run collectively). The process's device stays selected."""
    if request.node.get_closest_marker("multigpu") is None and detect_launch_env().is_multiprocess:
        for key in set(os.environ) - set(without_launcher_vars(os.environ)):
            monkeypatch.delenv(key)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash[_TALLY].current = item.nodeid


def _shard_key(item: pytest.Item):
    """None for a collective test; else the group this per-process test is run in."""
    if item.get_closest_marker("multigpu"):
        return None
    shard_by = item.get_closest_marker("shard_by")
    callspec = getattr(item, "callspec", None)
    if shard_by is None or callspec is None:
        return item.nodeid
    missing = [name for name in shard_by.args if name not in callspec.params]
    if missing:
        raise pytest.UsageError(f"{item.nodeid}: shard_by names parameters {missing} it lacks")
    return (item.path, item.originalname, tuple(callspec.params[name] for name in shard_by.args))


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: shard what is selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    env = detect_launch_env()
    if not env.is_multiprocess or env.world_size == 1 or not sharding_enabled(os.environ):
        return
    plan = plan_shard([_shard_key(item) for item in items], env.rank, env.world_size)
    config.stash[_PLAN] = plan
    keep = set(plan.order)
    deselected = [item for i, item in enumerate(items) if i not in keep]
    items[:] = [items[i] for i in plan.order]
    if deselected:
        config.hook.pytest_deselected(items=deselected)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a GPU machine, compile the selected tests' kernels first, in worker processes, into the
    kernel cache (tests/precompile_keys.py: compiling one at a time was half of the suite's time).
    DISTNORM_KERNEL_CACHE=0 turns it off with the cache."""
    import torch

    if not torch.cuda.is_available() or os.environ.get("DISTNORM_KERNEL_CACHE") == "0":
        return
    from precompile_keys import precompile_for

    line = precompile_for(session.items, detect_launch_env())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and line:
        reporter.write_line(line)


def pytest_report_header(config: pytest.Config) -> str | None:
    env = detect_launch_env()
    if not env.is_multiprocess:
        return None
    return f"distnorm: {env.launcher} rank {env.rank} of {env.world_size} (local rank {env.local_rank})"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    plan = config.stash.get(_PLAN, None)
    if plan is not None:
        terminalreporter.write_line(f"distnorm sharding: {plan.summary()}")
    for line in config.stash[_TALLY].summary():
        terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    plan = session.config.stash.get(_PLAN, None)
    if plan is not None and not plan.order and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        # the other ranks got the selected tests: an empty share is not a failure of this rank
        session.exitstatus = pytest.ExitCode.OK
    from distnorm.launch import shutdown

    try:
        shutdown()  # waits for the ranks still running their share, then destroys the groups
    except TimeoutError as e:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        sys.stderr.write(f"distnorm: torch.distributed shutdown failed: {e}\n")
