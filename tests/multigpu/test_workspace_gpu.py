"""Multi-GPU tests of distnorm.comm.Workspace, for every available backend.

Run any of:
    torchrun --nproc-per-node 4 -m pytest tests/multigpu/test_workspace_gpu.py -q
    mpirun -np 4 python -m pytest tests/multigpu/test_workspace_gpu.py -q
    python -m pytest tests/multigpu/test_workspace_gpu.py -q     # spawns one process per GPU

Test bodies are plain module-level functions (no fixtures) so spawn() can pickle them. Every
check is gathered over the group before asserting, so one rank's failure fails all ranks instead
of leaving them stuck in the next collective.
"""
import gc
import importlib.util
import os
import random
import warnings

import pytest
import torch

from distnorm.comm import BACKENDS, CommTimeoutError, Workspace, resolve_bootstrap
from harness import MULTIGPU_MARKS, SHARE_GPUS, TIMEOUT_S, WORLD, gathered_check as _gathered_check
from distnorm.launch import detect_launch_env, get_or_create_group, run_distributed

pytestmark = MULTIGPU_MARKS
MiB = 1 << 20


def _has_torch_symm() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def _unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot be tested here (None when it can)."""
    installed = {"vmm": True, "torch_symm": _has_torch_symm(),
                 "nvshmem": importlib.util.find_spec("nvshmem") is not None}
    if not installed[backend]:
        return f"{backend} not installed"
    if backend == "torch_symm" and SHARE_GPUS:  # its rendezvous rejects "overlapping devices"
        return "torch_symm needs a GPU per rank (DISTNORM_SHARE_GPUS=1)"
    return None


BACKEND_PARAMS = [pytest.param(b, marks=pytest.mark.skipif(why is not None, reason=why or ""))
                  for b, why in ((b, _unavailable(b)) for b in BACKENDS)]


# --- helpers (run on every rank) -----------------------------------------------------------

def _pattern(rank: int, nbytes: int, seed: int, device) -> torch.Tensor:
    """Rank-specific random bytes in [1, 255]: never zero, so never mistaken for fresh memory."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1009 + rank)
    return torch.randint(1, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _expect_zero(ws: Workspace, nbytes: int) -> None:
    for r in range(ws.world_size):
        assert int(ws.peer_buffer(r, torch.uint8, nbytes).count_nonzero()) == 0, f"data of {r}"
        assert int(ws.peer_signal(r, torch.uint8).count_nonzero()) == 0, f"signal pad of {r}"


def _write(ws: Workspace, nbytes: int, seed: int) -> None:
    ws.local_buffer(torch.uint8, nbytes).copy_(_pattern(ws.rank, nbytes, seed, ws.device))
    right = (ws.rank + 1) % ws.world_size
    ws.peer_signal(right)[ws.rank] = 1000 + ws.rank  # a store through the peer mapping
    torch.cuda.synchronize()


def _verify(ws: Workspace, nbytes: int, seed: int) -> None:
    for r in range(ws.world_size):
        expected = _pattern(r, nbytes, seed, ws.device)
        got = ws.peer_buffer(r, torch.uint8, nbytes)
        assert torch.equal(got, expected), f"data region of rank {r} differs"
        typed = ws.peer_buffer(r, torch.bfloat16, (4, 8))
        assert torch.equal(typed.view(torch.uint8).flatten(), expected[:64]), f"bf16 view of {r}"
        assert typed.device == ws.device and got.device == ws.device
    left = (ws.rank - 1) % ws.world_size
    assert int(ws.peer_signal(ws.rank)[left]) == 1000 + left, "left neighbour's signal missing"
    assert ws.buffer_ptrs.tolist() == ws.buffer_ptrs_host
    assert ws.signal_ptrs.tolist() == ws.signal_ptrs_host
    assert ws.buffer_ptrs.dtype == torch.int64 and ws.buffer_ptrs.device == ws.device
    assert len(set(ws.buffer_ptrs_host)) == ws.world_size


def _exercise(ws: Workspace, boot, nbytes: int) -> None:
    """Fresh memory is zero everywhere; random patterns written locally are read by all peers."""
    seed = boot.broadcast_object(random.getrandbits(30) if boot.rank == 0 else None)
    _gathered_check(boot, _expect_zero, ws, nbytes)
    _gathered_check(boot, _write, ws, nbytes, seed)
    _gathered_check(boot, _verify, ws, nbytes, seed)


def _world_boot():
    return resolve_bootstrap(None)


# --- bodies ---------------------------------------------------------------------------------
def _body_patterns(backend: str) -> None:
    boot = _world_boot()
    with Workspace(backend=backend, buffer_bytes=8 * MiB, signal_bytes=256 << 10) as ws:
        if not ws.p2p_ok:  # same answer on every rank
            pytest.skip(f"no peer mappings here: {ws.fallback_reason}")
        assert (ws.backend, ws.fallback_reason) == (backend, None)
        assert ws.single_node and ws.world_size == boot.world_size
        _exercise(ws, boot, 8 * MiB)
        ws.barrier()


def _body_subgroups(backend: str) -> None:
    import torch.distributed as dist

    boot = _world_boot()
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [get_or_create_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    # a WORLD workspace stays open while the pair workspaces are built at the same time
    with Workspace(backend=backend, buffer_bytes=2 * MiB, signal_bytes=64 << 10) as world_ws:
        if rank < 2 * len(pairs):
            pair = pairs[rank // 2]
            pair_boot = resolve_bootstrap(pair)
            with Workspace(pair, backend=backend, buffer_bytes=4 * MiB, signal_bytes=64 << 10) as ws:
                assert (ws.rank, ws.world_size) == (rank % 2, 2)
                _exercise(ws, pair_boot, 4 * MiB)
                ws.barrier()
        _exercise(world_ws, boot, 2 * MiB)
        boot.barrier()


def _open_close(backend: str) -> None:
    ws = Workspace(backend=backend, buffer_bytes=4 * MiB, signal_bytes=64 << 10)
    ws.local_buffer()[0] = 1
    ws.close()


def _settle(boot) -> tuple[int, int]:
    boot.barrier()  # every peer has unmapped our memory before we measure
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0], len(os.listdir("/proc/self/fd"))


def _body_lifecycle(backend: str, iterations: int) -> None:
    boot = _world_boot()
    _open_close(backend)  # warm-up: lazy driver/NCCL/pool state
    free0, fds0 = _settle(boot)
    for _ in range(iterations):
        _open_close(backend)
    free1, fds1 = _settle(boot)

    def check() -> None:
        # 100 leaked allocations of >= 4 MiB would be >= 400 MiB; 32 MiB leaves room for driver
        # bookkeeping that is not ours. Descriptors: +2 for lazily opened driver files.
        assert free0 - free1 <= 32 * MiB, f"free memory fell by {(free0 - free1) / MiB:.1f} MiB"
        assert fds1 - fds0 <= 2, f"open descriptors went from {fds0} to {fds1}"
    _gathered_check(boot, check)

    ws = Workspace(backend=backend, buffer_bytes=MiB, signal_bytes=64 << 10)
    ws.close()
    ws.close()  # idempotent
    assert ws.closed and not ws.p2p_ok
    if backend != "nvshmem":  # nvshmem's free is collective: __del__ cannot run it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ws = Workspace(backend=backend, buffer_bytes=MiB, signal_bytes=64 << 10)
            del ws
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) for w in caught)
    boot.barrier()


def _body_auto_and_errors() -> None:
    boot = _world_boot()
    with Workspace(buffer_bytes=2 * MiB) as ws:
        if ws.p2p_ok:
            assert ws.backend in BACKENDS and ws.fallback_reason is None
            _exercise(ws, boot, 2 * MiB)
        else:  # PCIe without P2P: a workspace without mappings that says why
            assert ws.backend == "none" and ws.fallback_reason
            with pytest.raises(RuntimeError, match="no peer mappings"):
                ws.peer_buffer(0)
        ws.raise_if_failed()
        # a device-side store to the pinned error words, as a timed-out kernel would do
        flag = ws.error_flag_device
        assert flag.device == ws.device and flag.data_ptr() == ws.error_flag.data_ptr()
        for word, value in enumerate((1, (ws.rank + 1) % ws.world_size, 7)):
            flag[word].fill_(value)  # a kernel storing to pinned host memory through UVA
        torch.cuda.synchronize()
        with pytest.raises(CommTimeoutError, match=f"rank {(ws.rank + 1) % ws.world_size} at epoch 7"):
            ws.raise_if_failed()
        ws.reset_error()
        ws.raise_if_failed()
        if ws.p2p_ok:
            with pytest.raises(ValueError, match="rank must be in"):
                ws.peer_buffer(ws.world_size)
            with pytest.raises(ValueError, match="holds"):
                ws.peer_buffer(0, torch.float32, (ws.buffer_bytes // 4 + 1,))
        ws.barrier()


def _body_mpi_bootstrap() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    boot = resolve_bootstrap(comm)
    with Workspace(comm, backend="vmm", buffer_bytes=4 * MiB, signal_bytes=64 << 10) as ws:
        assert (ws.rank, ws.world_size) == (comm.Get_rank(), comm.Get_size())
        _exercise(ws, boot, 4 * MiB)
        ws.barrier()


# --- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_peer_patterns(backend):
    run_distributed(_body_patterns, backend, timeout_s=TIMEOUT_S)


@pytest.mark.skipif(WORLD < 4, reason="subgroups {0,1},{2,3} need >= 4 ranks")
@pytest.mark.parametrize("backend", [b for b in BACKEND_PARAMS if b.values[0] != "nvshmem"])
def test_subgroups(backend):
    # nvshmem has one world per process (its first group), so it cannot serve pair subgroups
    run_distributed(_body_subgroups, backend, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_create_close_100_times_no_leak(backend):
    run_distributed(_body_lifecycle, backend, 100, timeout_s=TIMEOUT_S)


def test_auto_backend_and_error_flag():
    run_distributed(_body_auto_and_errors, timeout_s=TIMEOUT_S)


def test_mpi_bootstrap():
    if not detect_launch_env().is_mpi:
        pytest.skip("only under mpirun")
    try:
        from mpi4py import MPI  # noqa: F401
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"mpi4py unusable: {e}")
    run_distributed(_body_mpi_bootstrap, timeout_s=TIMEOUT_S)
