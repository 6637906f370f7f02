"""Launch environment parsing (torchrun / Open MPI / MPICH / single), MPI port bootstrap logic,
processes spawned from inside a launched rank, and shutdown (CPU, gloo)."""
import os
import sys
import time

import pytest

from distnorm.launch import dist as dist_mod
from distnorm.launch import spawn
from distnorm.launch.env import (NO_MULTICAST_ENV, LaunchEnv, apply_no_multicast_env,
                                 detect_launch_env, without_launcher_vars)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}


def test_single_process_default():
    assert detect_launch_env({}) == LaunchEnv(0, 0, 1, 1, "single")
    assert not detect_launch_env({}).is_multiprocess


def test_torchrun():
    env = detect_launch_env(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 8, 2)
    assert env.launcher == "torchrun" and env.is_multiprocess and not env.is_mpi


def test_torchrun_without_local_vars_assumes_one_node():
    env = detect_launch_env({"RANK": "2", "WORLD_SIZE": "4"})
    assert (env.local_rank, env.local_world_size) == (2, 4)


def test_openmpi():
    env = detect_launch_env(OPENMPI)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.launcher == "openmpi" and env.is_mpi


def test_mpich_hydra():
    env = detect_launch_env(MPICH)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (2, 2, 4, 4)
    assert env.launcher == "mpich" and env.is_mpi


def test_torchrun_variables_win_over_mpi():
    # a process spawned from an MPI rank describes itself through RANK/WORLD_SIZE
    env = detect_launch_env({**OPENMPI, "RANK": "0", "WORLD_SIZE": "2"})
    assert env.launcher == "torchrun" and env.world_size == 2


@pytest.mark.parametrize("environ, match", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is outside"),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, "rank -1 is outside"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, "local world size 3"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK"),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "4"}, "openmpi: local rank 4"),
    ({**MPICH, "PMI_RANK": "9"}, "mpich: rank 9"),
])
def test_inconsistent_values_raise(environ, match):
    with pytest.raises(ValueError, match=match):
        detect_launch_env(environ)


def test_launch_env_validates_launcher_name():
    with pytest.raises(ValueError, match="launcher must be one of"):
        LaunchEnv(0, 0, 1, 1, "slurm")


def test_no_multicast_env_overrides():
    environ = {"NCCL_NVLS_ENABLE": "1"}
    apply_no_multicast_env(environ)
    assert environ == NO_MULTICAST_ENV


class _FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size, self.sent = rank, size, None

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        assert root == 0
        if self.rank == 0:
            self.sent = obj
            return obj
        return ("10.0.0.1", 4321)


def test_mpirun_without_master_broadcasts_rank0_port(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    comm = _FakeComm(0, 4)
    monkeypatch.setattr(dist_mod, "mpi_comm_world", lambda: comm)
    dist_mod._ensure_master_addr(LaunchEnv(0, 0, 4, 4, "openmpi"))
    addr, port = comm.sent
    assert addr == "127.0.0.1" and 0 < port < 65536  # one node: loopback
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"] == str(port)


def test_mpirun_nonzero_rank_takes_broadcast(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(dist_mod, "mpi_comm_world", lambda: _FakeComm(3, 8))
    dist_mod._ensure_master_addr(LaunchEnv(3, 1, 8, 4, "mpich"))
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "4321")


def test_mpirun_comm_disagreeing_with_env_raises(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(dist_mod, "mpi_comm_world", lambda: _FakeComm(0, 2))
    with pytest.raises(RuntimeError, match="disagrees"):
        dist_mod._ensure_master_addr(LaunchEnv(0, 0, 4, 4, "openmpi"))


def test_torchrun_style_without_master_raises(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR/MASTER_PORT"):
        dist_mod._ensure_master_addr(LaunchEnv(0, 0, 2, 2, "torchrun"))


def test_mpi_comm_world_error_is_clear(monkeypatch):
    """Without an importable mpi4py the error says what to install. The import is made to fail
    rather than tried: importing mpi4py.MPI runs MPI_Init, and under a real mpirun with the
    launcher's variables hidden from per-process tests, MPI_Init ends the rank (exit 1, no report:
    seen on the GPU image's Open MPI)."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(RuntimeError, match="mpi4py"):
        dist_mod.mpi_comm_world()


def test_init_distributed_argument_checks():
    with pytest.raises(TypeError, match="backend"):
        dist_mod.init_distributed(backend=3)
    with pytest.raises(ValueError, match="timeout_s"):
        dist_mod.init_distributed(timeout_s=0)


def test_default_backend():
    assert dist_mod.default_backend(True, 2, 2) == "nccl"
    assert dist_mod.default_backend(True, 2, 8) == "nccl"
    assert dist_mod.default_backend(True, 2, 1) == "gloo"  # ranks share a GPU: NCCL refuses
    assert dist_mod.default_backend(False, 2, 0) == "gloo"


def test_launch_world_size_shares_one_gpu_only_when_asked(monkeypatch):
    import torch

    from distnorm.launch import launch_world_size

    for key in set(os.environ) - set(without_launcher_vars(os.environ)):
        monkeypatch.delenv(key)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpus, share, want in ((1, "0", 1), (1, "1", 2), (2, "1", 2), (4, "0", 4), (0, "1", 0)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        monkeypatch.setenv("DISTNORM_SHARE_GPUS", share)
        assert launch_world_size() == want, (gpus, share)


def _body_counts_ranks() -> None:
    import torch.distributed as dist

    assert dist.get_world_size() == 2


def test_free_port_picks_below_the_ephemeral_range():
    """bind(0) had handed two test processes spawning side by side (under torchrun on 2 GPUs) the
    same port (EADDRINUSE): free_port picks at random from PORT_RANGE instead."""
    low, high = dist_mod.PORT_RANGE
    ports = [dist_mod.free_port() for _ in range(20)]
    assert all(low <= p < high for p in ports) and len(set(ports)) > 1


def test_spawn_starts_again_when_the_ranks_cannot_connect(monkeypatch):
    """A job whose rank 0 cannot bind its store's port (held here, as another job would) is started
    again on a new port: no body ran, so that is safe."""
    import socket

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen(8)
    picks = [held.getsockname()[1]]
    real = dist_mod.free_port
    monkeypatch.setattr(dist_mod, "free_port",
                        lambda *a: picks.pop() if picks else real(*a))
    try:
        spawn(_body_counts_ranks, 2, timeout_s=120, cpu_only=True)
    finally:
        held.close()
    assert not picks  # the held port was tried first


def test_spawn_reports_a_rank_that_cannot_start_without_retrying():
    """A start failure that is not a connection problem is raised at once, as before."""
    from distnorm.launch.spawn import RendezvousError

    with pytest.raises((AssertionError, RuntimeError), match="no_such_backend") as info:
        spawn(_body_counts_ranks, 2, timeout_s=120, cpu_only=True, backend="no_such_backend")
    assert not isinstance(info.value, RendezvousError)


def test_free_port_is_bindable():
    import socket

    port = dist_mod.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_init_distributed_cuda_argument_checks():
    with pytest.raises(TypeError, match="cuda must be a bool"):
        dist_mod.init_distributed(cuda="no")
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        dist_mod.init_distributed(backend="nccl", cuda=False)


def test_shutdown_argument_checks():
    with pytest.raises(ValueError, match="timeout_s"):
        dist_mod.shutdown(timeout_s=0)
    with pytest.raises(ValueError, match="exit_timeout_s"):
        dist_mod.shutdown(exit_timeout_s=-1)


# --- processes started from inside a launched rank --------------------------------------------
def test_without_launcher_vars_drops_every_launchers_variables():
    environ = {**TORCHRUN, **OPENMPI, **MPICH, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
               "TORCHELASTIC_RUN_ID": "x", "PMIX_RANK": "5", "OMPI_MCA_btl": "self",
               "HYDRA_CONTROL_FD": "7", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1",
               "NCCL_NVLS_ENABLE": "0", "RANKING": "kept"}
    clean = without_launcher_vars(environ)
    assert clean == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0",
                     "RANKING": "kept"}
    assert detect_launch_env(clean) == LaunchEnv(0, 0, 1, 1, "single")
    assert "RANK" in environ  # the input is not modified


def _body_describes_itself(parent_port: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    assert detect_launch_env() == LaunchEnv(rank, rank, 2, 2, "torchrun")
    leaked = sorted(k for k in os.environ if k.startswith(("OMPI_", "PMI_", "TORCHELASTIC_")))
    assert not leaked, f"rank {rank} inherited {leaked}"
    assert os.environ["MASTER_PORT"] != parent_port
    assert os.environ["DISTNORM_TEST_EXTRA"] == "yes"
    assert dist.get_backend() == "gloo"


def test_spawn_children_leave_the_enclosing_launchers_job(monkeypatch):
    """A test that spawns from inside an mpirun / torchrun rank: the children form their own job."""
    for key, value in {**OPENMPI, **TORCHRUN, "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "1",
                       "TORCHELASTIC_RUN_ID": "outer"}.items():
        monkeypatch.setenv(key, value)
    assert detect_launch_env().rank == 3  # this process looks like rank 3 of an 8-rank job
    spawn(_body_describes_itself, 2, "1", timeout_s=60, cpu_only=True,
          env={"DISTNORM_TEST_EXTRA": "yes"})


def test_spawn_cpu_only_argument_checks():
    with pytest.raises(TypeError, match="cpu_only"):
        spawn(_body_describes_itself, 1, cpu_only=1)
    with pytest.raises(ValueError, match="cpu_only=True"):
        spawn(_body_describes_itself, 1, backend="nccl", cpu_only=True)


# --- shutdown: every rank leaves torch.distributed together ------------------------------------
def _body_shutdown_together(late_s: float) -> None:
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:
        time.sleep(late_s)  # rank 1 is still busy with its share of the tests
    start = time.monotonic()
    dist_mod.shutdown(timeout_s=60)
    waited = time.monotonic() - start
    assert not dist.is_initialized()
    if rank == 0:
        assert waited > late_s * 0.8, f"rank 0 left after {waited:.2f} s, before rank 1 arrived"
    dist_mod.shutdown()  # a no-op once shut down


def test_shutdown_waits_for_late_ranks_then_destroys():
    spawn(_body_shutdown_together, 2, 1.5, timeout_s=60, cpu_only=True)


def _body_shutdown_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()  # the store outlives the groups while held
    if dist.get_rank() == 0:
        with pytest.raises(TimeoutError, match="1 of 2 ranks reached"):
            dist_mod.shutdown(timeout_s=1)
        assert not dist.is_initialized()  # destroyed all the same
        store.wait(["distnorm/shutdown/0/left"])  # keep serving the store until rank 1 left
    else:
        store.wait(["distnorm/shutdown/0/arrived"])
        time.sleep(1.5)  # arrive after rank 0 gave up
        dist_mod.shutdown(timeout_s=30)


def test_shutdown_times_out_with_the_count():
    spawn(_body_shutdown_timeout, 2, timeout_s=60, cpu_only=True)


# --- persistent rank pool (run_distributed under plain pytest) --------------------------------
def _pool_body_sum(expected: int, pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    assert int(t) == expected, f"sum {int(t)} != {expected}"
    with open(os.path.join(pid_dir, f"rank{dist.get_rank()}"), "a") as f:
        f.write(f"{os.getpid()}\n")


def _pool_body_rank1_fails() -> None:
    import torch.distributed as dist

    assert dist.get_rank() != 1, "rank 1 says no"


def _pool_body_sleeps() -> None:
    time.sleep(30)


def test_rank_pool_reuses_its_ranks_and_dies_on_failure(tmp_path):
    from distnorm.launch.pool import RankPool

    pool = RankPool(2, cpu_only=True)
    try:
        for _ in range(3):
            pool.run(_pool_body_sum, 3, str(tmp_path), timeout_s=60)
        for rank in range(2):  # the same process ran every call
            pids = (tmp_path / f"rank{rank}").read_text().split()
            assert len(pids) == 3 and len(set(pids)) == 1
        with pytest.raises(AssertionError, match="rank 1 of 2 failed: AssertionError: rank 1 says no"):
            pool.run(_pool_body_rank1_fails, timeout_s=60)
        assert not pool.alive  # killed: a failed rank may leave a collective half done
        with pytest.raises(RuntimeError, match="closed"):
            pool.run(_pool_body_sum, 3, str(tmp_path))
    finally:
        pool.close()
    pool = RankPool(2, cpu_only=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish within 2 s"):
            pool.run(_pool_body_sleeps, timeout_s=2)
        assert time.monotonic() - t0 < 20 and not pool.alive
    finally:
        pool.close()
