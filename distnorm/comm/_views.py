"""Non-owning torch tensors over raw addresses (peer mappings), via a hand-made DLPack capsule.

``torch.as_tensor`` on ``__cuda_array_interface__`` asks the driver which device owns the pointer
and would label a peer mapping as the *peer's* GPU; DLPack lets us say "local device" ourselves.
The tensor keeps ``owner`` alive until it is freed; it never frees the memory.
"""
from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["tensor_from_ptr", "live_view_count", "zero_device_bytes"]

_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

# address of a _DLManagedTensor -> (struct, shape, strides, owner); popped by the deleter
_live: dict[int, tuple[Any, ...]] = {}


def _delete(managed: Any) -> None:
    try:
        _live.pop(ctypes.cast(managed, ctypes.c_void_p).value, None)
    except Exception:  # noqa: BLE001 - never raise into C
        pass


_DELETER = _Deleter(_delete)  # module-lifetime: C code calls it when the tensor dies

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def live_view_count() -> int:
    """Tensors made by tensor_from_ptr that torch has not freed yet (for leak tests)."""
    return len(_live)


def tensor_from_ptr(ptr: int, nbytes: int, device: Any, owner: Any = None) -> Any:
    """A 1-D uint8 tensor of ``nbytes`` at address ``ptr`` on ``device`` (``torch.device``).

    Does not own the memory: ``owner`` is kept alive while the tensor lives, and the caller must
    keep the memory mapped for that long. ``device`` "cpu" works too (used by the CPU tests).
    """
    import torch

    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"tensor_from_ptr: unsupported device {device}")
    if int(ptr) <= 0 or int(nbytes) < 0:
        raise ValueError(f"tensor_from_ptr: bad pointer {ptr:#x} or size {nbytes}")
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ctypes.c_void_p(int(ptr))
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        managed.dl_tensor.device = _DLDevice(_KDL_CUDA, index)
    else:
        managed.dl_tensor.device = _DLDevice(_KDL_CPU, 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _DELETER
    address = ctypes.addressof(managed)
    _live[address] = (managed, shape, strides, owner)
    try:
        capsule = _capsule_new(address, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _live.pop(address, None)
        raise


def zero_device_bytes(ptr: int, nbytes: int, device_index: int) -> None:
    """Zero ``nbytes`` at device address ``ptr`` of GPU ``device_index`` and wait for it (how the
    backends clear a fresh signal pad before the ranks agree that it is ready)."""
    import torch

    tensor_from_ptr(ptr, nbytes, torch.device("cuda", device_index)).zero_()
    torch.cuda.synchronize(device_index)
