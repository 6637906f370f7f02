"""Symmetric workspace: same-size peer-mapped buffers and signal pads on every rank of a group.

    from distnorm.launch import init_distributed
    from distnorm.comm import Workspace

    init_distributed()
    with Workspace(buffer_bytes=64 << 20) as ws:       # group=None: WORLD (or MPI under mpirun)
        mine = ws.peer_buffer(ws.rank, torch.bfloat16)   # my data region, as a tensor
        left = ws.peer_buffer((ws.rank - 1) % ws.world_size, torch.bfloat16)
        kernel(..., ws.buffer_ptrs, ws.signal_ptrs, ws.error_flag)   # int64 device tables
        ws.raise_if_failed()

Backends (same interface): ``"vmm"`` (CUDA VMM + POSIX fds, default), ``"torch_symm"``
(PyTorch symmetric memory), ``"nvshmem"`` (nvshmem4py). ``"auto"`` tries them in that order. When
the group spans nodes or its GPUs cannot reach each other (no P2P), the workspace is built without
mappings: ``p2p_ok`` is False, ``fallback_reason`` says why, and callers use NCCL instead.

Construction is collective over the group; ``close()`` is local except for the nvshmem backend
(collective ``nvshmem.core.free``). Tensors from ``peer_buffer`` / ``peer_signal`` must not be
used after ``close()``. Data regions and signal pads start zeroed, and no rank returns from the
constructor before every rank has zeroed its pad.
"""
from __future__ import annotations

import itertools
import logging
import math
import socket
import sys
import warnings
import weakref
from typing import Any, Callable

from distnorm.comm._views import tensor_from_ptr
from distnorm.comm.bootstrap import Bootstrap, resolve_bootstrap
from distnorm.collectives.layout import (DEVICE_ERROR_WORD, ERR_CODE, ERR_EPOCH, ERR_PEER,
                                         ERROR_MISMATCH, ERROR_NAMES, ERROR_NONE, ERROR_WORDS)
from distnorm.comm.errors import CommMismatchError, CommTimeoutError
from distnorm.launch.env import apply_no_multicast_env

__all__ = ["Workspace", "BACKENDS"]

log = logging.getLogger(__name__)

#: backend names, in the order ``backend="auto"`` tries them
BACKENDS = ("vmm", "torch_symm", "nvshmem")


def _backend_class(name: str) -> Any:
    if name == "vmm":
        from distnorm.comm.vmm import VmmAllocation
        return VmmAllocation
    if name == "torch_symm":
        from distnorm.comm.torch_symm import TorchSymmAllocation
        return TorchSymmAllocation
    from distnorm.comm.nvshmem import NvshmemAllocation
    return NvshmemAllocation


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _pinned_zeros(words: int) -> Any:
    import torch

    return torch.zeros(words, dtype=torch.int32, pin_memory=True)


def _ptr_table(ptrs: list[int], device: Any) -> Any:
    import torch

    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parsed_device(device: str) -> Any:
    """torch.device(device), a ValueError naming `device` for a string torch does not parse."""
    import torch

    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e


def _is_cpu(device: Any) -> bool:
    import torch

    if isinstance(device, str):
        device = _parsed_device(device)
    return isinstance(device, torch.device) and device.type == "cpu"


def _resolve_device(device: Any) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise TypeError("device must be None, an int, a str or a torch.device, got bool")
    if isinstance(device, int):
        index = device
    elif isinstance(device, (str, torch.device)):
        dev = _parsed_device(device) if isinstance(device, str) else device
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    else:
        raise TypeError(f"device must be None, an int, a str or a torch.device, "
                        f"got {type(device).__name__}")
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device index {index} outside [0, {torch.cuda.device_count()})")
    return index


def _gpu_id(index: int) -> str:
    """A name of GPU ``index`` that is the same in every process (UUID, else PCI address)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return "pci:{}:{}:{}".format(*(getattr(props, k, "?") for k in
                                   ("pci_domain_id", "pci_bus_id", "pci_device_id")))


def _ranks_per_node(ranks_per_node: Any, world: int) -> int | None:
    """Workspace's ranks_per_node: None, or an int >= 1 dividing the group size."""
    if ranks_per_node is None:
        return None
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise TypeError(f"ranks_per_node must be an int or None, got {type(ranks_per_node).__name__}")
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node must be >= 1 and divide the group size {world}, "
                         f"got {ranks_per_node}")
    return ranks_per_node


def _topology_problem(boot: Bootstrap, device_index: int) -> str | None:
    """Collective: why this group cannot use peer mappings (same answer on all ranks), or None."""
    import torch

    uuids = [_gpu_id(i) for i in range(torch.cuda.device_count())]
    me = {"host": socket.gethostname(), "boot": _boot_id(), "uuid": uuids[device_index]}
    peers = boot.all_gather_object(me)
    hosts = {(p["host"], p["boot"]) for p in peers}
    if len(hosts) > 1:
        return f"group spans {len(hosts)} nodes ({sorted(h for h, _ in hosts)})"
    problem = None
    for r, p in enumerate(peers):
        if p["uuid"] == me["uuid"] or p["uuid"] not in uuids:
            continue  # same GPU, or a GPU this process cannot see (checked when mapping)
        other = uuids.index(p["uuid"])
        if not torch.cuda.can_device_access_peer(device_index, other):
            problem = f"GPU {device_index} cannot access GPU {other} (rank {r}) peer-to-peer"
            break
    problems = [x for x in boot.all_gather_object(problem) if x]
    return problems[0] if problems else None


class Workspace:
    """Peer-mapped data regions and signal pads for one group. See the module docstring.

    group: None, a torch.distributed ProcessGroup, an mpi4py communicator, or a Bootstrap.
    buffer_bytes / signal_bytes: per-rank sizes of the data region and the signal pad.
    backend: "auto", "vmm", "torch_symm" or "nvshmem"; an explicit backend that fails raises.
      "none": no peer mappings even where they would work -- the ops take the torch.distributed
      path, as on a group spanning nodes (to test or benchmark that path on one machine).
    device: the local CUDA device (default: current), or "cpu": a workspace without peer memory
      whose ops run through torch.distributed (e.g. gloo) and the reference, for CPU tests of code
      that uses distnorm (slow; results as on the GPU up to the reference's rounding).
    timeout_s: how long to wait for peers while exchanging handles.
    ranks_per_node: None, or G dividing the group size: ranks are numbered node by node, G per
      node, and the path without peer memory runs as a chain of nodes instead of one flat row
      split (collectives/nodechain.py, NOTE [node chain]: fewer bytes between nodes; opt-in, not
      measured yet). Ignored where the peer kernels run. Given on one machine with
      backend="none", it exercises that path (tests). The group must be the whole job (the chain
      creates its node and column groups with dist.new_group, which every process enters).
    """

    # NOTE [workspace handle]
    # Compiled graphs cannot hold a Workspace (op schemas take ints, not objects), so every workspace
    # gets a number, never reused (unlike id()), and the custom ops find it again with from_handle.
    # A plain int attribute because torch.compile must read it while tracing: a function that
    # computed it (torch.compiler.assume_constant_result) needs constant arguments on torch 2.11,
    # and a Workspace is not one ("UserDefinedObjectVariable(Workspace) is not a constant").
    # Weak: a workspace in a compiled graph is not kept alive.
    _handles = itertools.count(1)
    _by_handle: "weakref.WeakValueDictionary[int, Workspace]" = weakref.WeakValueDictionary()

    @classmethod
    def from_handle(cls, handle: int) -> "Workspace | None":
        """The live workspace numbered `handle` (NOTE [workspace handle]), or None."""
        return cls._by_handle.get(handle)

    def __init__(self, group: Any = None, *, buffer_bytes: int = 64 << 20,
                 signal_bytes: int = 1 << 20, backend: str = "auto", device: Any = None,
                 timeout_s: float = 120.0, ranks_per_node: int | None = None) -> None:
        self._closed = True  # until fully built: __del__ of a failed __init__ stays quiet
        self.handle: int = next(Workspace._handles)  # NOTE [workspace handle]
        Workspace._by_handle[self.handle] = self
        self._impl: Any = None
        self._op_state: dict[str, Any] = {}
        self.buffer_bytes = _positive_int("buffer_bytes", buffer_bytes)
        self.signal_bytes = _positive_int("signal_bytes", signal_bytes)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if backend not in ("auto", "none") and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto', 'none' or one of {BACKENDS}, got {backend!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a float (seconds), got {type(timeout_s).__name__}")
        if not 0 < timeout_s < math.inf:  # an infinite wait is the hang the deadline exists for
            raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s}")
        apply_no_multicast_env()
        import torch

        if _is_cpu(device):
            self._open_cpu(group)
            self.ranks_per_node = _ranks_per_node(ranks_per_node, self.world_size)
            return
        if not torch.cuda.is_available():
            raise RuntimeError("distnorm.comm.Workspace needs a CUDA device, but torch sees none "
                               f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                               "use a CUDA build of torch on a machine with NVIDIA GPUs")
        self._torch = torch
        boot = resolve_bootstrap(group)
        self._boot = boot
        self.group = boot.group
        self.rank, self.world_size = boot.rank, boot.world_size
        self.ranks_per_node = _ranks_per_node(ranks_per_node, self.world_size)
        self.device_index = _resolve_device(device)
        self.device = torch.device("cuda", self.device_index)
        self.backend = "none"
        self.fallback_reason: str | None = None
        self.buffer_ptrs_host: list[int] = []
        self.signal_ptrs_host: list[int] = []
        self.buffer_ptrs: Any = None
        self.signal_ptrs: Any = None
        with torch.cuda.device(self.device_index):
            # collectives on the rank's own device (NCCL's object gathers stage through it)
            self._run_open_checks(boot)
            self.error_flag = _pinned_zeros(ERROR_WORDS)
            problem = _topology_problem(boot, self.device_index)
            self.single_node = problem is None or not problem.startswith("group spans")
            if problem is None and backend == "none":
                problem = "backend='none' asked for no peer mappings"
            if problem is None:
                self._impl, problem = self._open_backend(backend, boot, timeout_s)
            if self._impl is None:
                self.fallback_reason = problem
                log.info("distnorm.comm.Workspace: no peer mappings (%s); use the NCCL path", problem)
            else:
                try:
                    self.backend = self._impl.name
                    self.buffer_ptrs_host = [int(p) for p in self._impl.buffer_ptrs]
                    self.signal_ptrs_host = [int(p) for p in self._impl.signal_ptrs]
                    self.buffer_ptrs = _ptr_table(self.buffer_ptrs_host, self.device)
                    self.signal_ptrs = _ptr_table(self.signal_ptrs_host, self.device)
                except BaseException:
                    self._impl.close()
                    raise
        self._closed = False

    #: collective checks every rank runs while a workspace is built, each (bootstrap) -> None and
    #: raising on every rank alike; the op layers register theirs (collectives/__init__.py: the
    #: settings every rank must share), so this module needs nothing of theirs
    open_checks: list = []

    @staticmethod
    def _run_open_checks(boot: Bootstrap) -> None:
        for check in Workspace.open_checks:
            check(boot)

    def _open_cpu(self, group: Any) -> None:
        import torch

        self._torch = torch
        self._boot = resolve_bootstrap(group)
        self._run_open_checks(self._boot)
        self.group = self._boot.group
        self.rank, self.world_size = self._boot.rank, self._boot.world_size
        self.device_index, self.device = -1, torch.device("cpu")
        self.backend, self.single_node = "none", True
        self.fallback_reason = "CPU workspace: torch.distributed and the reference"
        self.buffer_ptrs_host, self.signal_ptrs_host = [], []
        self.buffer_ptrs = self.signal_ptrs = None
        self.error_flag = torch.zeros(ERROR_WORDS, dtype=torch.int32)
        self._closed = False

    def _open_backend(self, backend: str, boot: Bootstrap, timeout_s: float) -> tuple[Any, str | None]:
        names = BACKENDS if backend == "auto" else (backend,)
        failures: list[str] = []
        for name in names:
            try:
                impl = _backend_class(name)(boot, self.buffer_bytes, self.signal_bytes,
                                            self.device_index, timeout_s)
            except Exception as e:
                if backend != "auto":
                    raise RuntimeError(f"Workspace backend {name!r} failed: "
                                       f"{type(e).__name__}: {e}") from e
                failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            if boot.rank == 0:
                log.info("distnorm.comm.Workspace: backend %s for %d ranks%s", name,
                         boot.world_size, f" ({'; '.join(failures)})" if failures else "")
            return impl, None
        reason = "no symmetric-memory backend worked: " + "; ".join(failures)
        log.warning("distnorm.comm.Workspace: %s", reason)
        return None, reason

    # --- state -----------------------------------------------------------------------------
    @property
    def p2p_ok(self) -> bool:
        """True when peers are mapped and kernels may use buffer_ptrs / signal_ptrs."""
        return self._impl is not None and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error_flag_ptr(self) -> int:
        """Address of ``error_flag`` (pinned host memory; the same address works on the GPU)."""
        return int(self.error_flag.data_ptr())

    @property
    def error_flag_device(self) -> Any:
        """``error_flag`` as an int32 CUDA tensor of the local device (same pinned memory, UVA)."""
        view = self.__dict__.get("_error_flag_device")
        if view is None:  # owner: the pinned tensor, not self (no reference cycle)
            view = tensor_from_ptr(self.error_flag_ptr, ERROR_WORDS * 4, self.device,
                                   owner=self.error_flag).view(self._torch.int32)
            self._error_flag_device = view
        return view

    def op_state(self, name: str, factory: Callable[[], Any]) -> Any:
        """The state op family ``name`` keeps for this workspace (``factory()`` on first use, e.g.
        the all-reduce ops' AllReduceState). Dropped by ``close()``; it must not refer back to the
        workspace."""
        state = self._op_state.get(name)
        if state is None:
            state = self._op_state[name] = factory()
        return state

    def _require_mapped(self) -> None:
        if self._closed:
            raise RuntimeError("Workspace is closed")
        if self._impl is None:
            raise RuntimeError(f"Workspace has no peer mappings: {self.fallback_reason}")

    def _view(self, ptr: int, region_bytes: int, dtype: Any, shape: Any, what: str) -> Any:
        import torch

        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            shape = (region_bytes // itemsize,)
        elif isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * itemsize
        if any(s < 0 for s in shape) or nbytes > region_bytes:
            raise ValueError(f"shape {shape} of {dtype} needs {nbytes} bytes; the {what} holds "
                             f"{region_bytes}")
        return tensor_from_ptr(ptr, nbytes, self.device, owner=self).view(dtype).view(shape)

    def _check_rank(self, r: int) -> int:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"rank must be an int, got {type(r).__name__}")
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {r}")
        return r

    def peer_buffer(self, r: int, dtype: Any = None, shape: Any = None) -> Any:
        """Rank ``r``'s data region as a tensor on the local device (does not own the memory)."""
        import torch

        self._require_mapped()
        r = self._check_rank(r)
        return self._view(self.buffer_ptrs_host[r], self.buffer_bytes,
                          torch.uint8 if dtype is None else dtype, shape, "data region")

    def local_buffer(self, dtype: Any = None, shape: Any = None) -> Any:
        """This rank's own data region (``peer_buffer(self.rank, ...)``)."""
        return self.peer_buffer(self.rank, dtype, shape)

    def peer_signal(self, r: int, dtype: Any = None, shape: Any = None) -> Any:
        """Rank ``r``'s signal pad as a tensor (default int32 words)."""
        import torch

        self._require_mapped()
        r = self._check_rank(r)
        return self._view(self.signal_ptrs_host[r], self.signal_bytes,
                          torch.int32 if dtype is None else dtype, shape, "signal pad")

    def barrier(self) -> None:
        """Host barrier over the workspace's group (collective)."""
        with self._torch.cuda.device(self.device_index):
            self._boot.barrier()

    # --- device-side errors ----------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Raise CommTimeoutError (CommMismatchError for a mismatch) if a kernel recorded an error
        (synchronize the stream first). The all-reduce ops raise through
        distnorm.collectives.faults, which also says what each rank launched."""
        words = self.error_flag.tolist()
        code, peer, epoch = words[ERR_CODE], words[ERR_PEER], words[ERR_EPOCH]
        if code == ERROR_NONE:
            return
        if code == ERROR_MISMATCH:
            raise CommMismatchError(
                f"distnorm: rank {self.rank}: rank {peer} launched the same collective with other "
                "arguments. Call reset_error() before reusing the workspace.",
                rank=self.rank, peer=peer)
        name = ERROR_NAMES.get(code, f"error code {code}")
        raise CommTimeoutError(
            f"distnorm: rank {self.rank} ({name}) gave up waiting for rank {peer} at epoch "
            f"{epoch} (group of {self.world_size}, backend {self.backend}); a peer is stuck, died, "
            "or was launched with other arguments. Call reset_error() before reusing the workspace.",
            code=code, rank=self.rank, peer=peer, epoch=epoch)

    def reset_error(self) -> None:
        """Zero ``error_flag`` and this rank's device error word (layout.DEVICE_ERROR_WORD)."""
        self.error_flag.zero_()
        if (self._impl is not None and not self._closed
                and (DEVICE_ERROR_WORD + 1) * 4 <= self.signal_bytes):  # else no kernel can run
            pad = self.peer_signal(self.rank)
            pad[DEVICE_ERROR_WORD].zero_()
            if pad.is_cuda:
                self._torch.cuda.synchronize(pad.device)

    # --- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap peers and free this rank's memory. Idempotent. Collective only for nvshmem."""
        if self._closed:
            return
        self._closed = True
        import torch

        impl, self._impl = self._impl, None
        self.buffer_ptrs = self.signal_ptrs = None
        self._op_state.clear()
        if impl is not None:
            with torch.cuda.device(self.device_index):  # driver calls need our context current
                torch.cuda.synchronize(self.device_index)  # no kernel may still use the mappings
                impl.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        warnings.warn(f"unclosed {self!r}; call close() or use it as a context manager",
                      ResourceWarning, stacklevel=2)
        impl = getattr(self, "_impl", None)
        if sys.is_finalizing() or getattr(impl, "collective_close", False):
            return  # nvshmem's free is collective: cannot run from one rank's garbage collector
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from __del__
            pass

    def __repr__(self) -> str:
        g = self.__dict__.get
        state = "closed" if g("_closed", True) else (g("backend") if g("_impl") else "fallback")
        return (f"Workspace(rank={g('rank', '?')}, world_size={g('world_size', '?')}, {state}, "
                f"buffer_bytes={g('buffer_bytes')}, signal_bytes={g('signal_bytes')})")
