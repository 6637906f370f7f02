"""Symmetric workspace for the fused all-reduce kernels: peer buffers, signal pads, bootstrap.

    from distnorm.comm import Workspace
    with Workspace(group, buffer_bytes=64 << 20) as ws:
        ws.buffer_ptrs, ws.signal_ptrs        # int64 device tensors [world] of peer addresses
        ws.peer_buffer(r, torch.bfloat16)     # rank r's data region, viewed from this GPU

Nothing here touches CUDA at import time; cuda-python, mpi4py and nvshmem4py load on first use.
"""
from distnorm.comm._views import tensor_from_ptr
from distnorm.comm.bootstrap import Bootstrap, MPIBootstrap, TorchBootstrap, agree, resolve_bootstrap
from distnorm.comm.errors import (ERROR_MISMATCH, ERROR_NAMES, ERROR_NONE, ERROR_TIMEOUT,
                                  BackendUnavailable, CommError, CommMismatchError,
                                  CommTimeoutError)
from distnorm.comm.fdpass import exchange_fds
from distnorm.comm.workspace import BACKENDS, Workspace

__all__ = [
    "Workspace", "BACKENDS",
    "Bootstrap", "TorchBootstrap", "MPIBootstrap", "resolve_bootstrap", "agree",
    "CommError", "CommTimeoutError", "CommMismatchError", "BackendUnavailable",
    "ERROR_NONE", "ERROR_TIMEOUT", "ERROR_MISMATCH", "ERROR_NAMES",
    "exchange_fds", "tensor_from_ptr",
]
