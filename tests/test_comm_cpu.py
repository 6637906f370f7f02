"""CPU tests of the communication layer: fd passing between real processes over real sockets,
the torch.distributed (gloo) bootstrap through spawn(), spawn's failure handling, Workspace
argument checks and bootstrap choices. (The workspace over a faked CUDA driver, views and error
decoding: tests/test_workspace_fake_cuda.py.)

Processes started here use spawn(cpu_only=True): gloo and no GPU, also on GPU machines (three
ranks on two GPUs are fine), and, under torchrun / mpirun, their own job, not the launcher's."""
import gc
import importlib.util
import multiprocessing
import os
import re
import threading
import time
import uuid

import pytest
import torch

from distnorm.comm import (BackendUnavailable, Bootstrap, MPIBootstrap,
                           TorchBootstrap, Workspace, agree, exchange_fds, resolve_bootstrap)
from distnorm.comm.bootstrap import agreed
from distnorm.launch import get_or_create_group, spawn

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("distnorm-test")
    os.write(fd, content)
    return fd


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 64, 0)


def _content(rank: int, tag: str) -> bytes:
    return f"rank {rank} says hello on {tag}".encode()


# --- bodies run in spawned processes (module level: picklable) ------------------------------
def _body_bootstrap_and_fds(delay_s: float) -> None:
    import torch.distributed as dist

    boot = resolve_bootstrap(None)
    assert isinstance(boot, TorchBootstrap)
    rank, world = boot.rank, boot.world_size
    assert (rank, world) == (dist.get_rank(), dist.get_world_size())
    assert boot.all_gather_object({"r": rank}) == [{"r": r} for r in range(world)]
    assert boot.broadcast_object(f"from {rank}", root=world - 1) == f"from {world - 1}"
    boot.barrier()
    agree(boot, None, "nothing")  # no rank failed: returns
    with pytest.raises(BackendUnavailable, match=r"rank 1: broken"):
        agree(boot, "broken" if rank == 1 else None, "step")  # raises on *every* rank

    # fds over a real socket, ranks arriving late in reverse order (connect must retry)
    tag = boot.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
    time.sleep(delay_s * (world - 1 - rank))
    fd = _memfd(_content(rank, tag))
    fds = exchange_fds(fd, rank, world, tag, timeout_s=20)
    assert fds[rank] == fd
    for r, peer_fd in enumerate(fds):
        assert _read_fd(peer_fd) == _content(r, tag), f"rank {rank}: wrong content from {r}"
        os.close(peer_fd)

    # subgroup bootstrap: {0, 1} (rank 2 is not a member and must still call new_group)
    sub = get_or_create_group([0, 1])
    if rank in (0, 1):
        sboot = TorchBootstrap(sub)
        assert sboot.world_size == 2 and sboot.rank == rank
        assert sboot.all_gather_object(rank * 10) == [0, 10]
        assert sboot.broadcast_object(rank + 7, root=1) == 8
    else:
        with pytest.raises(ValueError, match="not a member"):
            TorchBootstrap(sub)
    boot.barrier()


def _body_raise_on_rank1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 blocks here until the parent kills it


def _body_assert() -> None:
    assert 1 + 1 == 3, "deliberate assertion"


def _body_sleep() -> None:
    time.sleep(600)


def _body_hang_at_exit() -> None:
    threading.Thread(target=time.sleep, args=(600,), daemon=False).start()  # blocks exit


# --- fd passing -------------------------------------------------------------------------------
def test_bootstrap_and_fd_exchange_across_real_processes():
    spawn(_body_bootstrap_and_fds, 3, 0.3, timeout_s=60, cpu_only=True)


def _threaded_exchange(world: int, tag: str) -> list:
    fds = [_memfd(_content(r, tag)) for r in range(world)]
    results, errors = [None] * world, []

    def run(r):
        try:
            results[r] = exchange_fds(fds[r], r, world, tag, timeout_s=10)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in reversed(range(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    for r in range(world):
        for p in range(world):
            assert _read_fd(results[r][p]) == _content(p, tag)
            if p != r:
                os.close(results[r][p])
        os.close(fds[r])
    return results


@pytest.mark.parametrize("mode", ["abstract", "directory"])
def test_fd_exchange_concurrent_tags(mode, monkeypatch, tmp_path):
    if mode == "directory":
        monkeypatch.setenv("DISTNORM_FDPASS_DIR", str(tmp_path))
    gc.collect()  # descriptors of earlier tests' finished processes and queues close now, not during
    before = len(os.listdir("/proc/self/fd"))
    # two exchanges at once with different tags must not mix
    outer = threading.Thread(target=_threaded_exchange, args=(3, "tagA" + uuid.uuid4().hex[:8]))
    outer.start()
    _threaded_exchange(4, "tagB" + uuid.uuid4().hex[:8])
    outer.join(30)
    assert len(os.listdir("/proc/self/fd")) == before  # every socket and fd closed
    if mode == "directory":
        assert os.listdir(tmp_path) == []  # socket files removed


def test_fd_exchange_times_out_clearly():
    fd = _memfd(b"x")
    before = len(os.listdir("/proc/self/fd"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 never opened its socket"):
        exchange_fds(fd, 0, 2, "lonely" + uuid.uuid4().hex[:8], timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert len(os.listdir("/proc/self/fd")) == before
    os.close(fd)


def test_fd_exchange_world_of_one_and_validation():
    fd = _memfd(b"x")
    assert exchange_fds(fd, 0, 1, "solo") == [fd]
    with pytest.raises(ValueError, match="rank"):
        exchange_fds(fd, 2, 2, "t")
    with pytest.raises(ValueError, match="tag"):
        exchange_fds(fd, 0, 2, "bad tag/")
    with pytest.raises(TypeError, match="my_fd"):
        exchange_fds("3", 0, 2, "t")
    os.close(fd)
    with pytest.raises(OSError):
        exchange_fds(fd, 0, 2, "closedfd")


# --- spawn --------------------------------------------------------------------------------
def _spawned_children_left(before: set) -> list:
    """Child processes alive now that were not before the spawn: under plain pytest on a machine
    with >= 2 GPUs the multi-GPU tests' rank pool (distnorm-pool-rank*) lives on beside them."""
    return [p for p in multiprocessing.active_children() if p not in before]


def test_spawn_propagates_child_exception_quickly():
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed: ValueError: deliberate") as info:
        spawn(_body_raise_on_rank1, 2, timeout_s=60, cpu_only=True)
    assert "Traceback" in str(info.value) and "_body_raise_on_rank1" in str(info.value)
    assert time.monotonic() - start < 30
    assert _spawned_children_left(before) == []  # rank 0, stuck in a barrier, was killed


def test_spawn_propagates_child_assertion():
    with pytest.raises(AssertionError, match="deliberate assertion"):
        spawn(_body_assert, 1, timeout_s=60, cpu_only=True)


def test_spawn_kills_children_on_timeout():
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        spawn(_body_sleep, 2, timeout_s=3, cpu_only=True)
    assert time.monotonic() - start < 20
    assert _spawned_children_left(before) == []


def test_spawn_kills_children_stuck_at_exit_after_success(monkeypatch):
    import importlib

    spawn_mod = importlib.import_module("distnorm.launch.spawn")  # the package's `spawn` is the function
    monkeypatch.setattr(spawn_mod, "_EXIT_GRACE_S", 0.5)
    before = set(multiprocessing.active_children())
    with pytest.warns(RuntimeWarning, match=r"ranks \[0\] passed but did not exit"):
        spawn(_body_hang_at_exit, 1, timeout_s=60, cpu_only=True)
    assert _spawned_children_left(before) == []


def test_spawn_argument_checks():
    with pytest.raises(ValueError, match="nprocs"):
        spawn(_body_sleep, 0)
    with pytest.raises(TypeError, match="fn"):
        spawn(None, 1)


# --- Workspace argument checks --------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"buffer_bytes": 0}, ValueError, "buffer_bytes"),
    ({"buffer_bytes": -5}, ValueError, "buffer_bytes"),
    ({"buffer_bytes": 1.5}, TypeError, "buffer_bytes"),
    ({"buffer_bytes": True}, TypeError, "buffer_bytes"),
    ({"signal_bytes": 0}, ValueError, "signal_bytes"),
    ({"backend": "nccl"}, ValueError, "backend"),
    ({"backend": None}, TypeError, "backend"),
    ({"timeout_s": 0}, ValueError, "timeout_s"),
])
def test_workspace_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Workspace(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_workspace_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        Workspace()


def test_workspace_group_errors(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the CUDA check
    with pytest.raises(ValueError, match="group=None.*init_distributed"):
        Workspace()
    with pytest.raises(TypeError, match="group must be"):
        Workspace(group=object())


def test_resolve_bootstrap_choices(monkeypatch):
    class Comm:  # duck-typed mpi4py communicator
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 2

        def allgather(self, obj):
            return [obj, obj]

        def bcast(self, obj, root=0):
            return obj

        def Barrier(self):
            pass

    boot = resolve_bootstrap(Comm())
    assert isinstance(boot, MPIBootstrap) and (boot.rank, boot.world_size) == (1, 2)
    assert boot.all_gather_object(3) == [3, 3]
    assert resolve_bootstrap(boot) is boot
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    # Only where mpi4py is absent: importing mpi4py.MPI here would run MPI_Init with the launcher's
    # variables faked, which under a real mpirun kills the whole rank (exit 1, no report).
    if importlib.util.find_spec("mpi4py") is None:
        with pytest.raises(RuntimeError, match="mpi4py"):  # mpirun env, no MPI library
            resolve_bootstrap(None)


def test_agree_reports_every_failed_rank():
    class Fake(Bootstrap):
        rank, world_size = 0, 3

        @property
        def group(self):
            return None

        def all_gather_object(self, obj):
            return [obj, "boom", None]

        def broadcast_object(self, obj, root=0):
            return obj

    with pytest.raises(BackendUnavailable, match=r"vmm map failed \(rank 0: mine; rank 1: boom\)"):
        agree(Fake(), "mine", "vmm map")

    # the context-manager form: an Exception in the block is reported the same way, on every rank
    with pytest.raises(BackendUnavailable, match=r"vmm map failed \(rank 0: OSError: mine; rank 1: boom\)"):
        with agreed(Fake(), "vmm map"):
            raise OSError("mine")

    class AllFine(Fake):
        def all_gather_object(self, obj):
            return [obj, None, None]

    with agreed(AllFine(), "step"):  # nothing raised anywhere: the block's results stand
        value = 1
    assert value == 1
    with pytest.raises(KeyboardInterrupt):  # not an Exception: propagates at once
        with agreed(AllFine(), "step"):
            raise KeyboardInterrupt


# --- views, error flag, driver error formatting -------------------------------------------------


# --- settings every rank must share ------------------------------------------------------------
def _body_settings_differ(env: dict) -> None:
    """Rank r sets env[r] (variable -> value, None: unset); a CPU workspace must refuse on every
    rank naming each differing variable and every rank's value, or be built when they agree."""
    import torch.distributed as dist

    import distnorm

    rank = dist.get_rank()
    differ = [k for k in env[0] if len({e[k] or SHARED_DEFAULTS[k] for e in env.values()}) > 1]
    for name, value in env[rank].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    message = None
    try:
        distnorm.Workspace(dist.group.WORLD, device="cpu").close()
    except ValueError as e:
        message = str(e)  # not the exception: its traceback would keep the group alive
    if differ:
        assert message is not None, "no ValueError"
        for k in differ:
            assert f"{k}: rank 0 " in message, message
        assert "set them alike on every rank" in message, message
    else:
        assert message is None, message
    # nothing left holding the group when the harness destroys it (gloo aborts the process at
    # exit when a group outlives its destruction), and both ranks done with it
    gc.collect()
    dist.barrier()


#: what an unset variable resolves to (collectives.plan.settings_ranks_share)
SHARED_DEFAULTS = {"DISTNORM_GATHER_BY": "epilogue-swizzled", "DISTNORM_NOPEER_FORM": "auto",
                   "DISTNORM_TWOSHOT_FORM": "auto", "DISTNORM_LAMPORT_FORM": "poll-all",
                   "DISTNORM_REDUCESCATTER_FORM": "auto", "DISTNORM_ROWGATHER_FORM": "auto"}


def test_the_settings_ranks_share_and_their_defaults(monkeypatch):
    from distnorm.collectives.plan import settings_ranks_share
    for name in SHARED_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert settings_ranks_share() == SHARED_DEFAULTS
    monkeypatch.setenv("DISTNORM_GATHER_BY", "nccl")
    assert settings_ranks_share()["DISTNORM_GATHER_BY"] == "nccl"


@pytest.mark.parametrize("env", [
    {0: {"DISTNORM_GATHER_BY": "nccl", "DISTNORM_NOPEER_FORM": None},
     1: {"DISTNORM_GATHER_BY": None, "DISTNORM_NOPEER_FORM": None}},
    {0: {"DISTNORM_GATHER_BY": None, "DISTNORM_NOPEER_FORM": "split"},
     1: {"DISTNORM_GATHER_BY": "peers", "DISTNORM_NOPEER_FORM": "gather"}},
    {0: {"DISTNORM_REDUCESCATTER_FORM": "serial", "DISTNORM_TWOSHOT_FORM": "pull"},
     1: {"DISTNORM_REDUCESCATTER_FORM": None, "DISTNORM_TWOSHOT_FORM": "push"}},
    # the same settings spelled out on one rank and left to the default on the other
    {0: {"DISTNORM_GATHER_BY": "peers", "DISTNORM_LAMPORT_FORM": "poll-all"},
     1: {"DISTNORM_GATHER_BY": None, "DISTNORM_LAMPORT_FORM": None}},
])
def test_workspace_refuses_ranks_with_different_settings(env):
    """DISTNORM_GATHER_BY, DISTNORM_NOPEER_FORM and the algorithms' forms choose the collectives
    and kernels of a call: ranks that differ would wait for each other until a timeout (NCCL's
    all_gather against an all_to_all: minutes), so the workspace refuses them when it is built."""
    spawn(_body_settings_differ, 2, env, timeout_s=120, cpu_only=True)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"buffer_bytes": -1}, ValueError, "buffer_bytes must be > 0"),
    ({"buffer_bytes": 1.5}, TypeError, "buffer_bytes must be an int"),
    ({"signal_bytes": 0}, ValueError, "signal_bytes must be > 0"),
    ({"backend": "ucx"}, ValueError, "backend must be 'auto', 'none' or one of"),
    ({"timeout_s": "3"}, TypeError, "timeout_s must be a float"),
    ({"timeout_s": True}, TypeError, "timeout_s must be a float"),
    ({"timeout_s": 0.0}, ValueError, "timeout_s must be finite and > 0"),
    ({"timeout_s": float("inf")}, ValueError, "timeout_s must be finite and > 0"),  # no deadline
    ({"timeout_s": float("nan")}, ValueError, "timeout_s must be finite and > 0"),
    ({"device": "tpu"}, ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
])
def test_workspace_argument_errors(kwargs, error, message):
    """Each bad Workspace argument is refused before any rank talks to another (so every rank
    raises alike), with the library's message naming it."""
    with pytest.raises(error, match=re.escape(message)):
        Workspace(None, **{"device": "cpu", **kwargs})
