"""Differences between the CuTe DSL versions we run on (4.3.5 on the GPU machine) and compile on
(the newest 4.x in CI), chosen by feature checks, not version strings.

Kernel modules import each other with absolute imports: the 4.3.5 DSL preprocessor re-executes a
kernel module's imports and cannot resolve relative ones.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from typing import Callable

import cutlass.cute as cute

try:  # 4.8 moved it to cutlass.runtime and re-exports it from cute.runtime; 4.3.5 has cute.runtime only
    from cutlass.cute.runtime import make_fake_stream  # noqa: F401 - re-exported
except ImportError:  # pragma: no cover
    from cutlass.runtime import make_fake_stream  # type: ignore  # noqa: F401

make_fake_tensor = cute.runtime.make_fake_tensor

try:  # 4.8 moved it to cutlass.memory (cutlass.utils' name warns that it goes); 4.3.5: utils only
    from cutlass.memory import SmemAllocator  # noqa: F401 - re-exported
except ImportError:  # pragma: no cover
    from cutlass.utils import SmemAllocator  # type: ignore  # noqa: F401


def sym_int(width: int = 32, divisibility: int = 1):
    """A symbolic (run-time) integer for a fake tensor's shape or stride."""
    return cute.sym_int(width, divisibility=divisibility)


#: One DEBUG record per kernel compiled, with its seconds as ``record.compile_s`` (the test suite
#: adds them up per test: compiling is most of what a test of a new kernel shape costs).
compile_log = logging.getLogger("distnorm.compile")


def compile_tvm_ffi(fn, *args, cache_key: tuple | None = None):
    """cute.compile with the TVM-FFI calling convention (~3.5 us per call instead of ~40 us).

    cache_key: the caller's compile-time key (its arguments, with stable reprs); with it the kernel
    is loaded from / stored to the on-disk cache (kernels/disk_cache.py), filed under the kernel
    class's name."""
    keep_ptx = bool(os.environ.get("DISTNORM_KEEP_PTX"))

    def build():
        start = time.perf_counter()
        compiled = cute.compile(fn, *args, options="--enable-tvm-ffi" + (" --keep-ptx" if keep_ptx else ""))
        seconds = time.perf_counter() - start
        compile_log.debug("compiled %s in %.2f s", type(fn).__name__, seconds, extra={"compile_s": seconds})
        return compiled

    if cache_key is None or keep_ptx:  # --keep-ptx wants the compile to happen
        return build()
    from distnorm.kernels.disk_cache import compile_cached

    return compile_cached(type(fn).__name__, cache_key, build)


def compiled_kernel(kernel_class: type) -> Callable:
    """Decorator for a builder of `kernel_class` kernels: `describe(*key)` returns (kernel object,
    its compile arguments); the decorated function returns the compiled kernel (compile_tvm_ffi),
    memoized per process and on disk under the class's name and all of its own arguments, defaults
    filled in. The whole compile-time key is the argument list, so a parameter added later cannot
    be left out of the disk cache's file name (a kernel of another configuration would load
    silently). `.cache_path(*key)` says where that file is (precompile)."""
    kind = kernel_class.__name__

    def decorate(describe: Callable) -> Callable:
        signature = inspect.signature(describe)

        def cache_key(*args, **kwargs) -> tuple:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments.values())

        @functools.cache
        @functools.wraps(describe)
        def compiled(*args, **kwargs):
            kernel, compile_args = describe(*args, **kwargs)
            assert type(kernel) is kernel_class, (type(kernel), kernel_class)
            return compile_tvm_ffi(kernel, *compile_args, cache_key=cache_key(*args, **kwargs))

        def cache_path(*args, **kwargs):
            from distnorm.kernels.disk_cache import kernel_path

            return kernel_path(kind, cache_key(*args, **kwargs))

        compiled.cache_key = cache_key
        compiled.cache_path = cache_path
        return compiled

    return decorate
