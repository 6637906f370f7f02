"""Launch environment parsing (torchrun / Open MPI / MPICH / single) and MPI port bootstrap logic."""
import os

import pytest

from distnorm.launch import dist as dist_mod
from distnorm.launch.env import (NO_MULTICAST_ENV, LaunchEnv, apply_no_multicast_env,
                                 detect_launch_env)

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


def test_mpi_comm_world_error_is_clear():
    try:
        from mpi4py import MPI  # noqa: F401
    except (ImportError, RuntimeError):
        with pytest.raises(RuntimeError, match="mpi4py"):
            dist_mod.mpi_comm_world()
    else:
        pytest.skip("mpi4py has a working MPI library here")


def test_init_distributed_argument_checks():
    with pytest.raises(TypeError, match="backend"):
        dist_mod.init_distributed(backend=3)
    with pytest.raises(ValueError, match="timeout_s"):
        dist_mod.init_distributed(timeout_s=0)


def test_free_port_is_bindable():
    import socket

    port = dist_mod.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
