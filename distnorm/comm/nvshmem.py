"""Symmetric memory from NVSHMEM through nvshmem4py (``nvshmem.core``), when it is installed.

NVSHMEM is initialized once per process from a unique id broadcast over the bootstrap; its PEs are
the ranks of that first group, so later workspaces must use the same set of processes. Each
workspace is one ``nvshmem.core.buffer`` (data region, then signal pad); peer addresses come from
``nvshmem.core.get_peer_buffer`` (``nvshmem_ptr``). ``NVSHMEM_DISABLE_NVLS=1`` keeps multicast
off. ``nvshmem.core.free`` is collective: close such a workspace on every rank together.
"""
from __future__ import annotations

import os
import socket
from typing import Any

from distnorm.comm._views import zero_device_bytes
from distnorm.comm.bootstrap import Bootstrap, agree, agreed

__all__ = ["NvshmemAllocation"]

_state: dict[str, Any] = {"members": None}


def _import() -> tuple[Any, Any]:
    import nvshmem.core as nvshmem

    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    return nvshmem, Device


def _init(nvshmem: Any, Device: Any, boot: Bootstrap, device_index: int) -> None:
    import numpy as np

    payload = None
    if boot.rank == 0:
        uid = nvshmem.get_unique_id()
        payload = uid._data.view(np.int8).tobytes()
    payload = boot.broadcast_object(payload)
    if boot.rank != 0:
        uid = nvshmem.get_unique_id(empty=True)
        uid._data.view(np.int8)[:] = np.frombuffer(payload, dtype=np.int8)
    device = Device(device_index)
    device.set_current()
    nvshmem.init(device=device, uid=uid, rank=boot.rank, nranks=boot.world_size,
                 initializer_method="uid")


class NvshmemAllocation:
    """One NVSHMEM symmetric buffer holding data region and signal pad."""

    name = "nvshmem"
    collective_close = True

    def __init__(self, boot: Bootstrap, buffer_bytes: int, signal_bytes: int, device_index: int,
                 timeout_s: float = 120.0) -> None:
        del timeout_s
        self._nvshmem: Any = None
        self._buffer: Any = None
        self._peers: list[Any] = []
        self.signal_offset = (buffer_bytes + 4095) // 4096 * 4096
        members = (socket.gethostname(), os.getpid())
        with agreed(boot, "nvshmem import"):
            nvshmem, Device = _import()
            if not all(hasattr(nvshmem, n) for n in ("init", "buffer", "free", "get_peer_buffer")):
                raise ImportError("nvshmem.core lacks init/buffer/free/get_peer_buffer")
        group = tuple(boot.all_gather_object(members))
        error = None
        if _state["members"] is not None and _state["members"] != group:
            error = ("already initialized in this process over another set of processes; "
                     "NVSHMEM has one world per process")
        agree(boot, error, "nvshmem world")
        if _state["members"] is None:
            with agreed(boot, "nvshmem init"):
                _init(nvshmem, Device, boot, device_index)
                _state["members"] = group
        self._nvshmem = nvshmem
        try:
            self._buffer = nvshmem.buffer(self.signal_offset + signal_bytes)  # collective
            with agreed(boot, "nvshmem buffer"):  # also the barrier after zeroing
                import torch

                base = int(self._buffer.handle)
                ptrs = []
                for r in range(boot.world_size):
                    if r == boot.rank:
                        ptrs.append(base)
                        continue
                    peer = nvshmem.get_peer_buffer(self._buffer, r)
                    self._peers.append(peer)
                    address = int(peer.handle) if peer is not None else 0
                    if address == 0:
                        raise RuntimeError(f"nvshmem_ptr gives no direct mapping of PE {r}")
                    ptrs.append(address)
                self.buffer_ptrs = ptrs
                self.signal_ptrs = [p + self.signal_offset for p in ptrs]
                zero_device_bytes(base, self.signal_offset + signal_bytes, device_index)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Free the buffer: collective over the NVSHMEM world (call on every rank)."""
        self._peers = []
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._nvshmem.free(buffer)
