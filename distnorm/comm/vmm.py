"""Symmetric memory from the CUDA driver's virtual memory API, shared by POSIX file descriptors.

Each rank ``cuMemCreate``s one allocation (data region, then signal pad) on its GPU, exports it as
a file descriptor, and all-gathers the descriptors over a Unix socket (:mod:`fdpass`). Every rank
then reserves one virtual range of ``world_size * size`` and maps peer ``r``'s allocation at
``base + r * size`` with read/write access for its own GPU. No multicast objects are ever made.

Teardown is local (no collective): a peer's memory stays alive while anyone maps it.
"""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from distnorm.comm.bootstrap import Bootstrap, agreed
from distnorm.comm.errors import BackendUnavailable
from distnorm.comm.fdpass import exchange_fds

__all__ = ["VmmAllocation", "driver"]

log = logging.getLogger(__name__)


def driver() -> Any:
    """cuda-python's driver module (``cuda.bindings.driver``, or the older ``cuda.cuda``)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        from cuda import cuda as cu  # cuda-python < 12.6
    return cu


def _check(result: Any, call: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple; raise naming ``call`` on failure."""
    cu = driver()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != cu.CUresult.CUDA_SUCCESS:
        try:
            _, name = cu.cuGetErrorName(err)
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001
            name = str(err)
        raise RuntimeError(f"{call} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class VmmAllocation:
    """One data region + signal pad per rank, every peer mapped here. See the module docstring."""

    name = "vmm"

    def __init__(self, boot: Bootstrap, buffer_bytes: int, signal_bytes: int, device_index: int,
                 timeout_s: float = 120.0) -> None:
        self._cu: Any = None
        self._retained_device: Any = None
        self._granularity = 0
        self._device_index = device_index
        self._handles: list[Any] = []   # own handle first, then imported ones
        self._mapped: list[int] = []    # addresses mapped in the reservation
        self._base = 0
        self._reserved = 0
        self._export_fd = -1
        self._peer_fds: list[int] = []
        self.size = 0
        self.signal_offset = _round_up(buffer_bytes, 4096)
        rank, world = boot.rank, boot.world_size
        try:
            # 1. local: driver, granularity (agreed as the max over ranks)
            error, granularity = None, 0
            try:
                cu = self._cu = driver()
                _check(cu.cuInit(0), "cuInit")
                self._ensure_context(device_index)
                self._prop = self._allocation_prop(device_index)
                granularity = int(_check(cu.cuMemGetAllocationGranularity(
                    self._prop,
                    cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                    "cuMemGetAllocationGranularity"))
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = f"{type(e).__name__}: {e}"
            gathered = boot.all_gather_object((error, granularity))
            failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
            if failed:  # every rank sees the same list, so every rank raises
                raise BackendUnavailable("vmm setup failed (" + "; ".join(failed) + ")")
            self._granularity = max(g for _, g in gathered)
            self.size = _round_up(self.signal_offset + signal_bytes, self._granularity)

            # 2. local: create and export
            with agreed(boot, "vmm cuMemCreate/export"):
                handle = _check(cu.cuMemCreate(self.size, self._prop, 0), "cuMemCreate")
                self._handles.append(handle)
                self._export_fd = int(_check(cu.cuMemExportToShareableHandle(
                    handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0), "cuMemExportToShareableHandle"))

            # 3. exchange descriptors among the group's processes
            tag = boot.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
            with agreed(boot, "vmm file-descriptor exchange"):
                fds = exchange_fds(self._export_fd, rank, world, tag, timeout_s=timeout_s)
                self._peer_fds = [fd for r, fd in enumerate(fds) if r != rank]
            os.close(self._export_fd)
            self._export_fd = -1

            # 4. import, reserve, map, grant access, zero my region
            with agreed(boot, "vmm import/map"):  # also the barrier after zeroing
                self._map_all(fds, rank, world)
                base = self._base + rank * self.size
                _check(cu.cuMemsetD8(base, 0, self.size), "cuMemsetD8")
                _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        except BaseException:
            self.close()
            raise
        self.buffer_ptrs = [self._base + r * self.size for r in range(world)]
        self.signal_ptrs = [p + self.signal_offset for p in self.buffer_ptrs]

    def _ensure_context(self, device_index: int) -> None:
        """Make sure a context of our device is current on this thread (torch's primary one)."""
        cu = self._cu
        ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is not None and int(ctx) != 0:
            current = int(_check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))
            if current == device_index:
                return
        device = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        self._retained_device = device
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _allocation_prop(self, device_index: int) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _map_all(self, fds: list[int], rank: int, world: int) -> None:
        cu = self._cu
        handle_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        total = world * self.size
        self._base = int(_check(cu.cuMemAddressReserve(total, self._granularity, 0, 0),
                                "cuMemAddressReserve"))
        self._reserved = total
        for r in range(world):
            if r == rank:
                handle = self._handles[0]
            else:
                handle = _check(cu.cuMemImportFromShareableHandle(fds[r], handle_type),
                                "cuMemImportFromShareableHandle")
                self._handles.append(handle)
                os.close(fds[r])  # the imported handle holds the reference now
                self._peer_fds.remove(fds[r])
            address = self._base + r * self.size
            _check(cu.cuMemMap(address, self.size, 0, handle, 0), "cuMemMap")
            self._mapped.append(address)
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self._device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(self._base, total, [access], 1), "cuMemSetAccess")

    def close(self) -> None:
        """Unmap, free the reservation, release handles, close descriptors. Local, idempotent."""
        errors: list[str] = []
        cu = self._cu

        def attempt(result_fn: Any, call: str) -> None:
            try:
                _check(result_fn(), call)
            except Exception as e:  # noqa: BLE001 - release as much as possible
                errors.append(str(e))

        if cu is not None and self._mapped:
            attempt(cu.cuCtxSynchronize, "cuCtxSynchronize")
        while self._mapped:
            address = self._mapped.pop()
            attempt(lambda a=address: cu.cuMemUnmap(a, self.size), "cuMemUnmap")
        if self._reserved:
            attempt(lambda: cu.cuMemAddressFree(self._base, self._reserved), "cuMemAddressFree")
            self._reserved = 0
        while self._handles:
            handle = self._handles.pop()
            attempt(lambda h=handle: cu.cuMemRelease(h), "cuMemRelease")
        for fd in [self._export_fd, *self._peer_fds]:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as e:
                    errors.append(f"close({fd}): {e}")
        self._export_fd, self._peer_fds = -1, []
        if self._retained_device is not None:
            attempt(lambda: cu.cuDevicePrimaryCtxRelease(self._retained_device),
                    "cuDevicePrimaryCtxRelease")
            self._retained_device = None
        if errors:
            raise RuntimeError("vmm close: " + "; ".join(errors))
