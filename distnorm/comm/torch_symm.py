"""Symmetric memory from PyTorch (``torch.distributed._symmetric_memory``): ``empty`` + ``rendezvous``.

Peer data addresses come from ``handle.buffer_ptrs`` (plus our tensor's offset in its block),
signal pads from ``handle.signal_pad_ptrs``. The signal pad size is process-wide in PyTorch and
can only grow before the first symmetric allocation; it is raised to ``signal_bytes`` when
possible and checked. Needs a torch.distributed group. Multicast is never used
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""
from __future__ import annotations

from typing import Any

from distnorm.comm._views import zero_device_bytes
from distnorm.comm.bootstrap import Bootstrap, TorchBootstrap, agreed
from distnorm.comm.errors import BackendUnavailable

__all__ = ["TorchSymmAllocation"]

_state = {"allocated": False}  # has this process made a symmetric allocation through us?


def _signal_pad_nbytes(handle: Any, rank: int) -> int | None:
    try:
        pad = handle.get_signal_pad(rank)
        return int(pad.numel() * pad.element_size())
    except Exception:  # noqa: BLE001 - older/newer signatures: unknown, checked elsewhere
        return None


def _rendezvous(symm_mem: Any, tensor: Any, group: Any) -> Any:
    try:
        return symm_mem.rendezvous(tensor, group)
    except (RuntimeError, TypeError):
        # PyTorch < 2.8 wants the group registered first, and its name rather than the group.
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is None:
            raise
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
        return symm_mem.rendezvous(tensor, group.group_name)


class TorchSymmAllocation:
    """A ``buffer_bytes`` uint8 symmetric tensor and PyTorch's signal pads, rendezvoused."""

    name = "torch_symm"

    def __init__(self, boot: Bootstrap, buffer_bytes: int, signal_bytes: int, device_index: int,
                 timeout_s: float = 120.0) -> None:
        del timeout_s  # rendezvous uses the group's own timeout
        self._tensor: Any = None
        self._handle: Any = None
        if not isinstance(boot, TorchBootstrap):
            raise BackendUnavailable("torch_symm needs a torch.distributed ProcessGroup, "
                                     f"not {type(boot).__name__}")
        import torch

        rank, world = boot.rank, boot.world_size
        try:
            with agreed(boot, "torch_symm allocation"):
                import torch.distributed._symmetric_memory as symm_mem

                get_size = getattr(symm_mem, "get_signal_pad_size", None)
                set_size = getattr(symm_mem, "set_signal_pad_size", None)
                if get_size is not None and set_size is not None and get_size() < signal_bytes:
                    if _state["allocated"]:  # PyTorch fixes the size at the first allocation
                        raise BackendUnavailable(
                            f"signal pads are {get_size()} bytes, {signal_bytes} requested, and "
                            "PyTorch cannot grow them after the first symmetric allocation; create "
                            "the workspace with the largest signal_bytes first")
                    set_size(signal_bytes)
                _state["allocated"] = True
                self._tensor = symm_mem.empty(buffer_bytes, dtype=torch.uint8,
                                              device=torch.device("cuda", device_index))
            with agreed(boot, "torch_symm rendezvous"):  # also the barrier after zeroing
                self._handle = _rendezvous(symm_mem, self._tensor, boot.group)
                bases = [int(p) for p in self._handle.buffer_ptrs]
                offset = self._tensor.data_ptr() - bases[rank]
                block = int(getattr(self._handle, "buffer_size", offset + buffer_bytes))
                if offset < 0 or offset + buffer_bytes > block:
                    raise RuntimeError(f"tensor at offset {offset} does not fit its block of {block}")
                self.buffer_ptrs = [b + offset for b in bases]
                self.signal_ptrs = [int(p) for p in self._handle.signal_pad_ptrs]
                if len(self.buffer_ptrs) != world or len(self.signal_ptrs) != world:
                    raise RuntimeError("rendezvous returned pointers for "
                                       f"{len(self.buffer_ptrs)} ranks, expected {world}")
                pad = _signal_pad_nbytes(self._handle, rank)
                if pad is not None and pad < signal_bytes:
                    raise RuntimeError(
                        f"signal pads are {pad} bytes, {signal_bytes} requested; PyTorch fixes the "
                        "size at the first symmetric allocation: call torch.distributed."
                        "_symmetric_memory.set_signal_pad_size() earlier or lower signal_bytes")
                self._tensor.zero_()
                zero_device_bytes(self.signal_ptrs[rank], signal_bytes, device_index)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the handle and tensor (memory returns to PyTorch's symmetric pool). Local."""
        self._handle = None
        self._tensor = None
