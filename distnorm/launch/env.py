"""Which launcher started this process, and this process's place in the job.

    >>> env = detect_launch_env()          # torchrun, Open MPI, MPICH/Hydra, or a single process
    >>> env.rank, env.world_size, env.local_rank, env.launcher

torchrun's variables (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, also set by
:func:`distnorm.launch.spawn`) take priority over MPI's, so a process spawned from an MPI rank
describes itself, not its parent.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "detect_launch_env", "LAUNCHERS", "NO_MULTICAST_ENV", "apply_no_multicast_env",
           "LAUNCHER_VARIABLES", "LAUNCHER_PREFIXES", "without_launcher_vars", "gpu_sharing_requested"]

#: launcher names, in the order they are looked for
LAUNCHERS = ("torchrun", "openmpi", "mpich", "single")

# launcher -> (rank, world size, local rank, local world size) variable names
_VARS: dict[str, tuple[str, str, str, str]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


@dataclass(frozen=True)
class LaunchEnv:
    """This process's rank in the job and on its node, and the launcher that said so."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str

    def __post_init__(self) -> None:
        _check_consistent(self.launcher, self.rank, self.world_size, self.local_rank,
                          self.local_world_size)

    @property
    def is_mpi(self) -> bool:
        """True when an MPI launcher (mpirun / mpiexec) started the process."""
        return self.launcher in ("openmpi", "mpich")

    @property
    def is_multiprocess(self) -> bool:
        """True when a launcher (not a plain ``python``) started the process."""
        return self.launcher != "single"


def _int_var(environ: Mapping[str, str], name: str, launcher: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{launcher}: environment variable {name}={raw!r} is not an integer") from None


def _check_consistent(launcher: str, rank: int, world: int, local_rank: int, local_world: int) -> None:
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if world < 1:
        raise ValueError(f"{launcher}: world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"{launcher}: rank {rank} is outside [0, world size {world})")
    if not 1 <= local_world <= world:
        raise ValueError(f"{launcher}: local world size {local_world} is outside [1, world size {world}]")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"{launcher}: local rank {local_rank} is outside [0, local world size {local_world})")


def _from_vars(environ: Mapping[str, str], launcher: str) -> LaunchEnv | None:
    rank_var, world_var, lrank_var, lworld_var = _VARS[launcher]
    rank = _int_var(environ, rank_var, launcher)
    world = _int_var(environ, world_var, launcher)
    if rank is None and world is None:
        return None
    if rank is None or world is None:
        missing = rank_var if rank is None else world_var
        present = world_var if rank is None else rank_var
        raise ValueError(f"{launcher}: {present} is set but {missing} is not")
    local_rank = _int_var(environ, lrank_var, launcher)
    local_world = _int_var(environ, lworld_var, launcher)
    if local_world is None:
        local_world = world  # without it, assume every rank is on this node
    if local_rank is None:
        local_rank = rank % local_world if local_world > 0 else 0
    return LaunchEnv(rank=rank, local_rank=local_rank, world_size=world,
                     local_world_size=local_world, launcher=launcher)


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's environment variables (default ``os.environ``).

    Raises ValueError naming the variable when values are missing, not integers or inconsistent
    (rank >= world size, local rank >= local world size, ...).
    """
    environ = os.environ if environ is None else environ
    for launcher in ("torchrun", "openmpi", "mpich"):
        env = _from_vars(environ, launcher)
        if env is not None:
            return env
    return LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher="single")


#: Variables through which a launcher tells a process its place in the job (torchrun's, and the
#: rendezvous address its ranks share).
LAUNCHER_VARIABLES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
})
#: Prefixes of the variables of torchrun's agent, Open MPI / PMIx, and MPICH / Hydra / PMI.
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPIR_")


def without_launcher_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) without any launcher's rank variables.

    A process started from inside a launched rank must not take its parent's place in the job:
    with the parent's ``OMPI_*`` variables an MPI library would join the parent's job, and
    :func:`detect_launch_env` would describe the parent.
    """
    environ = os.environ if environ is None else environ
    return {key: value for key, value in environ.items()
            if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)}


#: Environment that keeps NVLink multicast (NVLS / multimem) off in every library we touch.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_no_multicast_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Set NO_MULTICAST_ENV (overriding other values, with a warning); run before NCCL/NVSHMEM start.

    Multicast can take down GPUs that other jobs share on the machines this project runs on.
    """
    environ = os.environ if environ is None else environ
    for key, value in NO_MULTICAST_ENV.items():
        old = environ.get(key)
        if old is not None and old != value:
            logging.getLogger(__name__).warning(
                "distnorm: overriding %s=%s with %s (NVLink multicast stays off)", key, old, value)
        environ[key] = value


def gpu_sharing_requested(environ: Mapping[str, str] | None = None) -> bool:
    """DISTNORM_SHARE_GPUS=1: multi-GPU tests may run more ranks than GPUs (ranks share a GPU,
    time-sliced: a check of correctness only; docs/TESTING.md)."""
    environ = os.environ if environ is None else environ
    return environ.get("DISTNORM_SHARE_GPUS", "0") == "1"
