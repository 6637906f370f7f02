"""Inline PTX for the TMA's bulk copies (cp.async.bulk), written once: the reduce-scatter's
"pipelined-tma" pushes (NOTE [bulk-copy pushes] in kernels/reducescatter.py, rounds in
kernels/bulkpush.py), the "roles-tma" pushers (kernels/rolespush.py) and the push measurement
kernel (tests/push_kernel.py). The mbarrier waits are kernels/ptx.py's (mbarrier_try_wait).

Addresses: `saddr` / `mbar` are 32-bit shared-space addresses (ptx.smem_ptr_u32), `gaddr` 64-bit
global ones; every address and byte count a multiple of 16.
"""
from __future__ import annotations

from cutlass.cutlass_dsl import dsl_user_op

# absolute imports: the 4.3.5 DSL preprocessor needs them
from distnorm.kernels.ptx import inline_asm, ir_i32, ir_i64

__all__ = ["bulk_store_s2g", "bulk_wait_all", "bulk_wait_read_all", "bulk_wait_all_but_newest",
           "bulk_wait_read_all_but_newest", "bulk_commit_empty", "mbar_init", "bulk_load_g2s",
           "mbar_arrive_expect_tx", "bulk_copy_g2s", "fence_proxy_async",
           "fence_proxy_async_shared"]


@dsl_user_op
def bulk_store_s2g(gaddr, saddr, nbytes, *, loc=None, ip=None) -> None:
    """cp.async.bulk of nbytes from shared-space address saddr to global address gaddr, committed
    as a bulk group of its own."""
    inline_asm(None, [ir_i64(gaddr, loc, ip), ir_i32(saddr, loc, ip), ir_i32(nbytes, loc, ip)],
               "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;\n\t"
               "cp.async.bulk.commit_group;", "l,r,r,~{memory}", True)


@dsl_user_op
def bulk_wait_all(*, loc=None, ip=None) -> None:
    """Wait until every bulk group this thread committed has completed (its writes performed)."""
    inline_asm(None, [], "cp.async.bulk.wait_group 0;", "~{memory}", True)


@dsl_user_op
def bulk_wait_read_all(*, loc=None, ip=None) -> None:
    """Wait until every bulk group this thread committed has read its shared-memory source."""
    inline_asm(None, [], "cp.async.bulk.wait_group.read 0;", "~{memory}", True)


@dsl_user_op
def bulk_commit_empty(*, loc=None, ip=None) -> None:
    """Commit an empty bulk group (complete at once): the roles-tma pushers count one group per
    part, stored or not, so that "all but the newest" names the same part either way."""
    inline_asm(None, [], "cp.async.bulk.commit_group;", "~{memory}", True)


@dsl_user_op
def bulk_wait_all_but_newest(*, loc=None, ip=None) -> None:
    """Wait until every bulk group this thread committed but the newest one has completed (the
    roles-tma pushers keep one part's store in flight while they flag the one before:
    kernels/rolespush.py)."""
    inline_asm(None, [], "cp.async.bulk.wait_group 1;", "~{memory}", True)


@dsl_user_op
def bulk_wait_read_all_but_newest(*, loc=None, ip=None) -> None:
    """Wait until every bulk group this thread committed but the newest one has read its
    shared-memory source."""
    inline_asm(None, [], "cp.async.bulk.wait_group.read 1;", "~{memory}", True)


@dsl_user_op
def mbar_init(mbar, *, loc=None, ip=None) -> None:
    """Initialize the shared-memory mbarrier at mbar for one arrival per phase, visible to the
    async proxy."""
    inline_asm(None, [ir_i32(mbar, loc, ip)], "mbarrier.init.shared::cta.b64 [$0], 1;\n\t"
               "fence.mbarrier_init.release.cluster;", "r,~{memory}", True)


@dsl_user_op
def mbar_arrive_expect_tx(mbar, nbytes, *, loc=None, ip=None) -> None:
    """This phase's one arrival at the mbarrier at mbar, expecting nbytes (0: the phase completes
    at once); the copies that bring them (bulk_copy_g2s) may be issued after it."""
    inline_asm(None, [ir_i32(mbar, loc, ip), ir_i32(nbytes, loc, ip)],
               "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r,~{memory}", True)


@dsl_user_op
def bulk_copy_g2s(saddr, gaddr, nbytes, mbar, *, loc=None, ip=None) -> None:
    """cp.async.bulk of nbytes from global gaddr into shared saddr, counted on the mbarrier at mbar
    (whose phase expects them: mbar_arrive_expect_tx)."""
    inline_asm(None, [ir_i32(saddr, loc, ip), ir_i64(gaddr, loc, ip), ir_i32(nbytes, loc, ip),
                      ir_i32(mbar, loc, ip)],
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, "
               "[$3];", "r,l,r,r,~{memory}", True)


def bulk_load_g2s(saddr, gaddr, nbytes, mbar) -> None:
    """cp.async.bulk of nbytes from global gaddr into shared saddr, with the mbarrier at mbar's
    one arrival expecting them (its phase completes when they have landed): for a phase of one
    copy."""
    mbar_arrive_expect_tx(mbar, nbytes)
    bulk_copy_g2s(saddr, gaddr, nbytes, mbar)


@dsl_user_op
def fence_proxy_async(*, loc=None, ip=None) -> None:
    """Order this thread's memory operations between the generic and the async (TMA) proxies, in
    every state space (global as well as shared)."""
    inline_asm(None, [], "fence.proxy.async;", "~{memory}", True)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Order shared memory between the generic and the async (TMA) proxies."""
    inline_asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", True)
