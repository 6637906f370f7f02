"""Peers to benchmark against, in the same process as distnorm: FlashInfer's fused all-reduce
(trtllm_allreduce_fusion from flashinfer-python 0.7, the incumbent), PyTorch symmetric memory, NCCL.

FlashInfer 0.7 probes for `cutlass` at import and then wants CuTe DSL >= 4.6, while the GPU machine
carries 4.3.5: import it first with the CuTe DSL's directory hidden from sys.path. Measuring stick only.
"""
from __future__ import annotations

import sys


def import_flashinfer():
    """flashinfer.comm, or None with the reason printed. Call before anything imports cutlass."""
    if "cutlass" in sys.modules:
        print("flashinfer: skipped (cutlass already imported)")
        return None
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if "cutlass" not in p]
    try:
        import flashinfer.comm as fi_comm
        return fi_comm
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"flashinfer: not available ({type(e).__name__}: {str(e)[:200]})")
        return None
    finally:
        sys.path[:] = saved
        for name in [m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")]:
            del sys.modules[name]


class FlashInferFusion:
    """trtllm_allreduce_fusion with an IPC workspace for one hidden size."""

    def __init__(self, fi_comm, rank: int, world: int, max_tokens: int, hidden: int, group):
        self.fi = fi_comm
        self.rank, self.world, self.hidden = rank, world, hidden
        out = fi_comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world, max_tokens, hidden, use_fp32_lamport=False, group=group, create_metadata=True)
        self.ipc_handles, self.workspace, self.metadata = out[0], out[1], out[-1]
        self.group = group

    def call(self, x, residual, weight, *, residual_out, norm_out=None, quant_out=None, scale=None,
             pdl=False, use_oneshot=None):
        P = self.fi.AllReduceFusionPattern
        pattern = P.kARResidualRMSNormFP8Quant if quant_out is not None else P.kARResidualRMSNorm
        self.fi.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=self.world, world_rank=self.rank, token_num=x.shape[0],
            hidden_dim=self.hidden, workspace_ptrs=self.workspace, launch_with_pdl=pdl,
            trigger_completion_at_end=True, fp32_acc=True, pattern_code=pattern,
            use_oneshot=use_oneshot, allreduce_out=None, residual_in=residual,
            residual_out=residual_out, norm_out=norm_out, quant_out=quant_out, scale_out=None,
            rms_gamma=weight, rms_eps=1e-6, scale_factor=scale, layout_code=None, metadata=self.metadata)

    def close(self):
        try:
            self.fi.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.ipc_handles, group=self.group)
        except Exception:  # noqa: BLE001
            pass


class SymmMemAllReduce:
    """torch.ops.symm_mem one-shot / two-shot all-reduce (no multicast) on a symmetric buffer."""

    def __init__(self, numel: int, dtype, device, group):
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, group=group)
        self.group_name = group.group_name
        self.ops = torch.ops.symm_mem

    def one_shot(self, x):
        n = x.numel()
        self.buf[:n].copy_(x.view(-1))
        return self.ops.one_shot_all_reduce(self.buf[:n], "sum", self.group_name)

    def two_shot(self, x):
        n = x.numel()
        self.buf[:n].copy_(x.view(-1))
        self.ops.two_shot_all_reduce_(self.buf[:n], "sum", self.group_name)
        return self.buf[:n]
