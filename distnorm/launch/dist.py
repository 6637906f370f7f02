"""Start ``torch.distributed`` from whatever launched the process.

    env = init_distributed()             # torchrun, mpirun, spawn(), or one plain process
    tp = get_or_create_group([0, 1])     # collective over WORLD: every rank calls it
    ...
    shutdown()                           # at the end of a job: every rank leaves together

On GPU machines each process uses GPU ``local_rank`` and NCCL (bound with ``device_id``); without
CUDA, gloo. Under mpirun without MASTER_ADDR/MASTER_PORT, rank 0 picks a free port and mpi4py
broadcasts it. NVLink multicast is switched off (``NO_MULTICAST_ENV``) before NCCL starts.
"""
from __future__ import annotations

import inspect
import logging
import os
import random
import socket
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from distnorm.launch.env import LaunchEnv, apply_no_multicast_env, detect_launch_env

__all__ = ["init_distributed", "cleanup", "shutdown", "get_or_create_group", "split_world",
           "free_port", "mpi_comm_world", "local_device_index"]

log = logging.getLogger(__name__)

_groups: dict[tuple[int, ...], Any] = {}


#: free_port's range: below Linux's ephemeral ports (32768-60999), which the OS hands out for bind(0)
#: and outgoing connections, so two processes picking at the same moment do not get the same one.
PORT_RANGE = (20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago: a random one of PORT_RANGE that binds.

    Not bind(0): the OS gives the same just-released port to the next process that asks, so two
    test processes spawning jobs side by side (under torchrun on 2 GPUs) got one port and the
    second job's rank 0 failed with EADDRINUSE."""
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in {PORT_RANGE} on {host!r} after 100 tries")


def mpi_comm_world() -> Any:
    """``mpi4py.MPI.COMM_WORLD``, imported lazily, with an error that says what to install."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:  # RuntimeError: mpi4py present but no libmpi
        raise RuntimeError(
            "this process was started by mpirun, and bootstrapping needs mpi4py with a working MPI "
            f"library ({type(e).__name__}: {e}). Install mpi4py built against the MPI that runs "
            "the job, or export MASTER_ADDR and MASTER_PORT so torch.distributed can start alone."
        ) from e
    return MPI.COMM_WORLD


def local_device_index(env: LaunchEnv) -> int:
    """GPU index for this process: ``local_rank``, wrapped (with a warning) if GPUs are fewer."""
    import torch

    count = torch.cuda.device_count()
    if env.local_rank >= count:
        warnings.warn(f"local rank {env.local_rank} >= visible GPUs {count}; GPUs will be shared",
                      RuntimeWarning, stacklevel=3)
    return env.local_rank % count


def default_backend(use_cuda: bool, local_ranks: int, gpus: int) -> str:
    """torch.distributed's backend when none is given: NCCL on GPUs, gloo without them, and gloo
    when this node's ranks outnumber its GPUs (NCCL refuses two ranks on one GPU: "Duplicate GPU
    detected"; the ranks then share GPUs, e.g. DISTNORM_SHARE_GPUS=1 tests)."""
    return "nccl" if use_cuda and local_ranks <= gpus else "gloo"


def _ensure_master_addr(env: LaunchEnv) -> None:
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return
    if not env.is_mpi:
        raise RuntimeError(
            f"launcher {env.launcher!r} set RANK/WORLD_SIZE but not MASTER_ADDR/MASTER_PORT; "
            "export both (torchrun and distnorm.launch.spawn set them)")
    comm = mpi_comm_world()
    if comm.Get_size() != env.world_size or comm.Get_rank() != env.rank:
        raise RuntimeError(f"MPI COMM_WORLD (rank {comm.Get_rank()} of {comm.Get_size()}) disagrees "
                           f"with the launch environment {env}")
    payload = None
    if env.rank == 0:
        single_node = env.local_world_size == env.world_size
        addr = "127.0.0.1" if single_node else socket.gethostname()
        payload = (addr, free_port("127.0.0.1" if single_node else ""))
    addr, port = comm.bcast(payload, root=0)
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0,
                     cuda: bool | None = None) -> LaunchEnv:
    """Initialize ``torch.distributed`` for this process once; later calls return the same env.

    backend: ``None``: ``default_backend`` (NCCL with a GPU per rank, else gloo).
    timeout_s: collective timeout handed to ``init_process_group``.
    cuda: ``None`` uses CUDA when a GPU is visible; ``False`` keeps this process off the GPUs
        (gloo, no device selected: CPU work may run more ranks than there are GPUs); ``True``
        requires a GPU.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if cuda is not None and not isinstance(cuda, bool):
        raise TypeError(f"cuda must be a bool or None, got {type(cuda).__name__}")
    if cuda is False and backend is not None and "nccl" in backend:
        raise ValueError(f"backend {backend!r} needs CUDA, but cuda=False")
    apply_no_multicast_env()
    import torch
    import torch.distributed as dist

    env = detect_launch_env()
    gpu_visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if cuda and not gpu_visible:
        raise RuntimeError("init_distributed(cuda=True): torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    use_cuda = gpu_visible if cuda is None else cuda
    device_index = None
    if use_cuda:
        device_index = local_device_index(env)
        torch.cuda.set_device(device_index)

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) != (env.rank, env.world_size):
            if env.launcher != "single":
                raise RuntimeError(f"torch.distributed is initialized as rank {rank} of {world}, "
                                   f"but the launch environment says {env}")
            env = LaunchEnv(rank, rank, world, world, "single")
        return env

    if backend is None:
        backend = default_backend(use_cuda, env.local_world_size,
                                  torch.cuda.device_count() if use_cuda else 0)
    kwargs: dict[str, Any] = {
        "backend": backend,
        "rank": env.rank,
        "world_size": env.world_size,
        "timeout": timedelta(seconds=timeout_s),
    }
    if "nccl" in backend and use_cuda and \
            "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = torch.device("cuda", device_index)
    if env.world_size == 1 and not os.environ.get("MASTER_PORT"):
        kwargs["store"] = dist.HashStore()
    else:
        _ensure_master_addr(env)
        kwargs["init_method"] = "env://"
    dist.init_process_group(**kwargs)
    log.debug("torch.distributed up: %s backend=%s", env, backend)
    return env


def get_or_create_group(ranks: Sequence[int], backend: str | None = None) -> Any:
    """The ProcessGroup of ``ranks`` (WORLD ranks), created once and cached.

    Collective over WORLD: every rank must call it with the same ``ranks`` in the same order,
    also ranks that are not members (they get ``None``-like non-member groups back).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("get_or_create_group: call init_distributed() first")
    key = tuple(int(r) for r in ranks)
    if len(set(key)) != len(key) or not key:
        raise ValueError(f"ranks must be distinct and non-empty, got {list(ranks)}")
    world = dist.get_world_size()
    if any(not 0 <= r < world for r in key):
        raise ValueError(f"ranks {list(key)} outside [0, {world})")
    if key not in _groups:
        _groups[key] = dist.new_group(list(key), backend=backend)
    return _groups[key]


def split_world(group_size: int, backend: str | None = None) -> Any:
    """Split WORLD into consecutive groups of ``group_size`` and return this rank's (collective)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if group_size < 1 or world % group_size:
        raise ValueError(f"group_size must divide the world size {world}, got {group_size}")
    mine = None
    for start in range(0, world, group_size):
        group = get_or_create_group(range(start, start + group_size), backend)
        if start <= dist.get_rank() < start + group_size:
            mine = group
    return mine


def cleanup() -> None:
    """Destroy the process groups made here and WORLD; safe to call when nothing is initialized."""
    import torch.distributed as dist

    _groups.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_shutdowns = 0  # how many shutdown() calls this process made: keys stay unique in a reused store


def _store_barrier(store: Any, key: str, world: int, timeout_s: float) -> None:
    """Wait on the rendezvous store until all ``world`` ranks passed ``key``.

    The store, not a collective: a rank that finished its share early may wait here for minutes
    without a communicator's watchdog timing out and aborting the job.
    """
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"], timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the store raises several types for a timeout
        try:
            arrived = f"{store.add(f'{key}/arrived', 0)} of {world}"
        except Exception:  # noqa: BLE001 - the store itself is gone
            arrived = f"not all {world}"
        raise TimeoutError(f"{arrived} ranks reached {key!r} within {timeout_s:g} s "
                           f"({type(e).__name__}: {e})") from e


def shutdown(timeout_s: float = 900.0, exit_timeout_s: float = 60.0) -> None:
    """Leave ``torch.distributed`` together at the end of a job; a no-op when it is not initialized.

    Every rank waits for the others (through the rendezvous store, up to ``timeout_s``), destroys
    its process groups (no "destroy_process_group() was not called" warning at exit), and rank 0,
    which hosts the store under mpirun and spawn(), then waits up to ``exit_timeout_s`` for the
    others to have destroyed theirs: a rank that exits while its peers still talk to its store
    makes their heartbeat threads print connection errors.

    Raises TimeoutError when the ranks do not all arrive within ``timeout_s`` (after destroying the
    process groups here).
    """
    global _shutdowns
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not exit_timeout_s > 0:
        raise ValueError(f"exit_timeout_s must be > 0, got {exit_timeout_s}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _groups.clear()
        return
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()  # held here: it outlives the process groups
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"distnorm/shutdown/{_shutdowns}"
    _shutdowns += 1
    try:
        _store_barrier(store, key, world, timeout_s)
    finally:
        cleanup()
    try:
        store.add(f"{key}/left", 1)
        if rank == 0:
            _wait_for_count(store, f"{key}/left", world, exit_timeout_s)
    except Exception as e:  # noqa: BLE001 - the groups are gone; leaving late is not an error
        log.warning("shutdown: rank %d could not wait for the others to leave (%s: %s)",
                    rank, type(e).__name__, e)


def _wait_for_count(store: Any, key: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key!r} did not reach {count} within {timeout_s:g} s")
        time.sleep(0.01)
