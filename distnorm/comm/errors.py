"""Errors of the communication layer. The error codes kernels write to ``Workspace.error_flag`` and
the device error word are defined with the rest of the workspace layout in
``distnorm.collectives.layout``."""
from __future__ import annotations

from distnorm.collectives.layout import (DEVICE_ERROR_WORD, ERROR_MISMATCH, ERROR_NAMES, ERROR_NONE,
                                         ERROR_TIMEOUT)

__all__ = ["CommError", "CommTimeoutError", "CommMismatchError", "BackendUnavailable",
           "ERROR_NONE", "ERROR_TIMEOUT", "ERROR_MISMATCH", "ERROR_NAMES", "DEVICE_ERROR_WORD"]


class CommError(RuntimeError):
    """Base class of distnorm.comm errors."""


class CommTimeoutError(CommError):
    """A kernel timed out waiting for a peer (recorded in ``Workspace.error_flag``)."""

    def __init__(self, message: str, *, code: int = ERROR_TIMEOUT, rank: int = -1, peer: int = -1,
                 epoch: int = -1) -> None:
        super().__init__(message)
        self.code, self.rank, self.peer, self.epoch = code, rank, peer, epoch


class CommMismatchError(CommTimeoutError):
    """A peer launched the same collective with other arguments (M, H, dtype, format, outputs or
    algorithm). `differences` lists 'field: this rank's vs the peer's' when known."""

    def __init__(self, message: str, *, rank: int = -1, peer: int = -1,
                 differences: tuple = ()) -> None:
        super().__init__(message, code=ERROR_MISMATCH, rank=rank, peer=peer)
        self.differences = tuple(differences)


class BackendUnavailable(CommError):
    """A symmetric-memory backend could not be set up here (raised on every rank of the group)."""
