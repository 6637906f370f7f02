"""The path without peer memory for a group spread over nodes: node-local row slices, a chain of
running float32 sums between nodes, the epilogue on the last node. Opt-in
(`Workspace(..., ranks_per_node=G)`): see NOTE [node chain].

NOTE [node chain]
The ops' sum is the float32 fold x_0 + x_1 + ... + x_{N-1} in rank order (bitwise the peer
kernels'), so a node cannot add its ranks' rows into one partial and ship that: (x_2 + x_3) added to
(x_0 + x_1) is not the fold. What can travel is the running fold itself. Ranks are numbered node by
node (rank = node * G + local); local rank j of every node owns row slice j of a G-way split
(rowsplit.slice_bounds(M, G, j)). Per chunk of rows:
  1. every node: all_to_all inside the node, so local rank j holds slice j of its node's G inputs;
  2. node 0's rank j folds them (x_0 + ... + x_{G-1}) and sends the float32 result to rank j of
     node 1, which continues the fold with its own G slices, and so on to the last node;
  3. the last node's rank j runs the norm-quant epilogue of slice j (the single-GPU kernel:
     bitwise the peer kernels' rows, NOTE [batch invariance]) and broadcasts the outputs to rank j
     of every other node (the "column" of local rank j);
  4. every node all_gathers its slices' outputs inside the node.
Bytes between nodes, per GPU and element of x (bf16 x, FP8 outputs: 2 bytes residual + 1 q), for
two nodes of G GPUs: 4/G sent as running sums + 3/G of outputs received, against about 1 sent and
1.5 received by the flat row split (rowsplit.py: every rank sends x slices to and receives outputs
from the N - G ranks of the other node) -- about 3x less at G = 8. The price: the nodes work in
sequence (one hop per node of latency, not pipelined across chunks here) and node-local traffic
(NCCL over NVLink) is as in the flat split. Whether that wins depends on the inter-node link. On
one host as two 2-GPU "nodes" (4 x H100, benchmarks/results/fallback_h100_x4.md) it was 3.7-9.7x
slower than the flat split (the hops in sequence, every collective NCCL's); no multi-node machine
has been lent, hence opt-in.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from distnorm.collectives.rowsplit import (exchange_slices, fold_slices, gather_rows, row_bytes,
                                           slice_bounds)

__all__ = ["NodeChain"]


class NodeChain:
    """The node chain of one workspace's group (NOTE [node chain]); collective to build (every
    rank of the group creates every node and column group, in the same order).

    The same three steps as rowsplit.FlatSplit: bounds(M) (this rank's slice), reduce(x) (its
    float32 sum on the last node, None elsewhere), gather(t, M, like) (every slice in row order).
    """

    def __init__(self, group, ranks_per_node: int) -> None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        if len(ranks) != dist.get_world_size():
            # dist.new_group must be entered by every process of the job; a subgroup's members
            # alone would wait there for the others forever
            raise ValueError(f"ranks_per_node needs a workspace whose group is the whole job "
                             f"({dist.get_world_size()} ranks); this one has {len(ranks)}")
        me = dist.get_rank(group)
        G = ranks_per_node
        self.nodes, self.node, self.local = len(ranks) // G, me // G, me % G
        self.G = G
        self.node_group = self.column_group = None
        for n in range(self.nodes):  # every rank creates every group, in the same order
            g = dist.new_group(ranks[n * G:(n + 1) * G])
            if n == self.node:
                self.node_group = g
        for j in range(G):
            g = dist.new_group(ranks[j::G])
            if j == self.local:
                self.column_group = g
        # global ranks of this rank's column, by node
        self.column = ranks[self.local::G]

    @property
    def last(self) -> bool:
        return self.node == self.nodes - 1

    def bounds(self, M: int) -> tuple[int, int]:
        return slice_bounds(M, self.G, self.local)

    def reduce(self, x: Tensor) -> Optional[Tensor]:
        """x [M, H] of this rank -> float32 [rows of slice j, H], the fold over every rank of the
        group (last node only; None on the others, after passing their running sum on)."""
        M, H = x.shape
        parts = exchange_slices(x, self.node_group)
        start, stop = self.bounds(M)
        rows = stop - start
        if rows == 0:  # every node agrees: the same slice of the same M
            return x.new_zeros(0, H, dtype=torch.float32) if self.last else None
        acc = None
        if self.node > 0:
            acc = torch.empty(rows, H, dtype=torch.float32, device=x.device)
            _recv(acc, self.column[self.node - 1])
        acc = fold_slices(parts, rows, acc)
        if self.last:
            return acc
        _send(acc, self.column[self.node + 1])
        return None

    def gather(self, t: Optional[Tensor], M: int, like: Tensor) -> Tensor:
        """Every rank's slice rows in row order: [M, ...]. t: this slice's rows on the last node
        (None elsewhere); like: a tensor with the rows' dtype and row shape (the output)."""
        import torch.distributed as dist

        start, stop = self.bounds(M)
        shape = (stop - start,) + tuple(like.shape[1:])
        if self.nodes > 1 and stop > start:
            raw = row_bytes(t if t is not None else like.new_empty(shape))
            dist.broadcast(raw, src=self.column[-1], group=self.column_group)
            t = raw.view(like.dtype).reshape(shape)
        elif t is None:
            t = torch.empty(shape, dtype=like.dtype, device=like.device)
        return gather_rows(t, M, self.node_group)


def _through_cpu(t: Tensor) -> bool:
    """gloo's send / recv take CPU tensors only: a CUDA tensor aborts the process (ranks that share
    GPUs run gloo, distnorm.launch.default_backend)."""
    import torch.distributed as dist
    return t.is_cuda and dist.get_backend() == "gloo"


def _send(t: Tensor, dst: int) -> None:
    import torch.distributed as dist
    dist.send(t.cpu() if _through_cpu(t) else t, dst=dst)


def _recv(t: Tensor, src: int) -> None:
    import torch.distributed as dist
    if _through_cpu(t):
        staged = torch.empty_like(t, device="cpu")
        dist.recv(staged, src=src)
        t.copy_(staged)
    else:
        dist.recv(t, src=src)
