"""Errors of the communication layer, and the error codes kernels write to ``Workspace.error_flag``.

``error_flag`` words: 0 = error code (``ERROR_*``), 1 = the rank that was waited on, 2 = epoch.

``DEVICE_ERROR_WORD``: a u32 word of each rank's own signal pad (device memory) that a timing-out
kernel sets beside ``error_flag`` and that spinning threads poll to give up early. Spinning threads
never read ``error_flag`` itself: it is pinned host memory, and a GPU read of it over PCIe (slow in
a VM) inside a spin loop made every wait that reached the check late enough to trigger the check
on the peers too (whole benchmark cases ran 10x slow, 2026-11-21).
"""
from __future__ import annotations

__all__ = ["CommError", "CommTimeoutError", "BackendUnavailable", "ERROR_NONE", "ERROR_TIMEOUT",
           "ERROR_NAMES", "DEVICE_ERROR_WORD"]

ERROR_NONE = 0
ERROR_TIMEOUT = 1  # a device-side wait on a peer's flag gave up
ERROR_NAMES = {ERROR_NONE: "none", ERROR_TIMEOUT: "timeout"}
DEVICE_ERROR_WORD = 4 * (1024 + 1024 * 8)  # first word of signal-pad region 4 (kernels/sync.py)


class CommError(RuntimeError):
    """Base class of distnorm.comm errors."""


class CommTimeoutError(CommError):
    """A kernel timed out waiting for a peer (recorded in ``Workspace.error_flag``)."""

    def __init__(self, message: str, *, code: int = ERROR_TIMEOUT, rank: int = -1, peer: int = -1,
                 epoch: int = -1) -> None:
        super().__init__(message)
        self.code, self.rank, self.peer, self.epoch = code, rank, peer, epoch


class BackendUnavailable(CommError):
    """A symmetric-memory backend could not be set up here (raised on every rank of the group)."""
