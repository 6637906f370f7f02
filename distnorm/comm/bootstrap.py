"""Host-side collectives that set up a workspace: a torch.distributed group or an MPI communicator.

    boot = resolve_bootstrap(None)     # WORLD if torch.distributed is up, else MPI under mpirun
    boot = TorchBootstrap(tp_group)    # any ProcessGroup (object collectives, any backend)
    boot = MPIBootstrap(comm)          # any mpi4py communicator
    peers = boot.all_gather_object(x); y = boot.broadcast_object(y, root=0); boot.barrier()

All three calls are collective and blocking on the host.
"""
from __future__ import annotations

import abc
from typing import Any

from distnorm.comm.errors import BackendUnavailable

__all__ = ["Bootstrap", "TorchBootstrap", "MPIBootstrap", "resolve_bootstrap", "agree", "agreed"]


class Bootstrap(abc.ABC):
    """The collectives a workspace needs; ranks are group-local (0..world_size-1)."""

    rank: int
    world_size: int

    @property
    @abc.abstractmethod
    def group(self) -> Any:
        """The underlying group object (ProcessGroup, mpi4py communicator, ...)."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), indexed by rank."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank (other ranks' argument is ignored)."""

    def barrier(self) -> None:
        """Return once every rank has entered (host-synchronous)."""
        self.all_gather_object(None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class TorchBootstrap(Bootstrap):
    """Bootstrap over a ``torch.distributed`` ProcessGroup (``None`` = WORLD)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group: torch.distributed is not initialized; call "
                             "distnorm.launch.init_distributed() first or pass an MPI communicator")
        self._dist = dist
        self._group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self._group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given ProcessGroup")
        self.world_size = dist.get_world_size(self._group)

    @property
    def group(self) -> Any:
        return self._group

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        src = self._dist.get_global_rank(self._group, root)
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]


class MPIBootstrap(Bootstrap):
    """Bootstrap over an mpi4py communicator (``None`` = COMM_WORLD)."""

    def __init__(self, comm: Any = None) -> None:
        if comm is None:
            from distnorm.launch.dist import mpi_comm_world

            comm = mpi_comm_world()
        self._comm = comm
        self.rank = int(comm.Get_rank())
        self.world_size = int(comm.Get_size())

    @property
    def group(self) -> Any:
        return self._comm

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()


def _is_mpi_comm(obj: Any) -> bool:
    return all(hasattr(obj, name) for name in ("Get_rank", "Get_size", "allgather", "bcast", "Barrier"))


def resolve_bootstrap(group: Any = None) -> Bootstrap:
    """Bootstrap for ``group``: a Bootstrap, a ProcessGroup, an mpi4py communicator, or None.

    None means torch.distributed's WORLD when initialized, else MPI COMM_WORLD when mpirun
    started the process; otherwise ValueError.
    """
    if isinstance(group, Bootstrap):
        return group
    if group is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return TorchBootstrap(None)
        from distnorm.launch.env import detect_launch_env

        if detect_launch_env().is_mpi:
            return MPIBootstrap(None)
        raise ValueError("group=None, but torch.distributed is not initialized and mpirun did not "
                         "start this process; call distnorm.launch.init_distributed() first, or "
                         "pass group= (a ProcessGroup, an mpi4py communicator or a Bootstrap)")
    if _is_mpi_comm(group):
        return MPIBootstrap(group)
    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # torch built without distributed
        ProcessGroup = ()  # type: ignore[assignment,misc]
    if isinstance(group, ProcessGroup):
        return TorchBootstrap(group)
    raise TypeError("group must be None, a torch.distributed ProcessGroup, an mpi4py communicator "
                    f"or a distnorm.comm.Bootstrap, got {type(group).__name__}")


def agree(boot: Bootstrap, error: str | None, what: str) -> None:
    """Collective: raise BackendUnavailable on every rank if ``error`` is set on any rank.

    Keeps all ranks on the same path: no rank goes on to the next collective step while
    another has failed.
    """
    errors = boot.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise BackendUnavailable(f"{what} failed ({detail})")


class agreed:
    """``with agreed(boot, what): ...`` -- run a setup step on every rank, then ``agree`` on it.

    An Exception raised in the block is not raised on its own: every rank leaves the block, and
    then every rank raises BackendUnavailable naming each failed rank's error (so no rank goes on
    to the next collective step alone). Other BaseExceptions propagate at once.
    """

    def __init__(self, boot: Bootstrap, what: str) -> None:
        self.boot, self.what = boot, what

    def __enter__(self) -> "agreed":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and not issubclass(exc_type, Exception):
            return False
        agree(self.boot, None if exc is None else f"{exc_type.__name__}: {exc}", self.what)
        return True
