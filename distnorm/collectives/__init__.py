"""The all-reduce host side: one place for what the fused all-reduce ops need besides the kernels.

    layout.py    where things live in a workspace (signal-pad regions, error words, buffer split);
                 pure Python, imported by comm/ and the kernels too
    plan.py      algorithm registry, crossover tables, rows per launch, tuning (pure Python)
    signature.py the call descriptor every rank of a launch must agree on
    faults.py    deadlines, recorded errors and the messages that explain them
    state.py     the per-workspace state (AllReduceState), owned by the workspace
    dispatch.py  running one call: kernels over peer mappings, or the NCCL fallback
    ops.py       the user-facing ops and their torch.library registration
    rowsplit.py  collectives by row slices over torch.distributed (the path without peer memory)
    nodechain.py the same path as a chain of nodes (Workspace(ranks_per_node=G), opt-in)
    seqpar.py    the sequence-parallel ops (reduce-scatter + norm-quant, all-gather)
    peergather.py their all-gathers through the peer mappings (the row gather kernel)
"""
from distnorm.collectives.ops import allreduce, allreduce_add_rmsnorm, check, reset
from distnorm.collectives.plan import check_shared_settings
from distnorm.collectives.seqpar import (all_gather, all_gather_scales,
                                         reduce_scatter_add_rmsnorm, shard_rows)
from distnorm.comm.workspace import Workspace

if check_shared_settings not in Workspace.open_checks:  # the settings ranks must share
    Workspace.open_checks.append(check_shared_settings)

__all__ = ["allreduce", "allreduce_add_rmsnorm", "reset", "check", "reduce_scatter_add_rmsnorm",
           "all_gather", "all_gather_scales", "shard_rows"]
