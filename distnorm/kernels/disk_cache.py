"""Compiled kernels kept on disk, so that a new process loads them instead of compiling again.

Compiling one kernel takes about a second (CuTe DSL 4.3.5 on an H200 machine); loading it from disk
takes milliseconds. An inference server's start-up and every test process pay the compiles once
per machine instead of once per process.

A kernel's file is named by a digest of everything its code depends on: the compile-time key the
caller gives (kernel kind and arguments), distnorm's sources (all of them: the kernels also take
constants from collectives/layout.py, plan.py and signature.py, and a kernel built with an old
signal-pad layout would hang or corrupt), the CuTe DSL version and the target GPU architecture. A change to any of them gives a new name, so
a stale kernel is never loaded. Files are written to a temporary name and renamed, so concurrent
processes (ranks, test workers) never read half a file.

``DISTNORM_KERNEL_CACHE``: the directory (default ``$XDG_CACHE_HOME/distnorm/kernels`` or
``~/.cache/distnorm/kernels``); ``0`` turns the cache off.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger("distnorm.compile")

CACHE_ENV = "DISTNORM_KERNEL_CACHE"


def cache_dir() -> Optional[Path]:
    """The cache directory, or None when ``DISTNORM_KERNEL_CACHE=0``."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured == "0":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "distnorm" / "kernels"


def source_files() -> list[Path]:
    """distnorm's Python sources: what a kernel's code may come from."""
    package = Path(__file__).resolve().parent.parent
    return sorted(package.rglob("*.py"))


@functools.cache
def source_digest() -> str:
    """SHA-256 over distnorm's sources (their paths within the package and their bytes)."""
    package = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in source_files():
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _toolchain() -> str:
    """CuTe DSL version and target architecture: a kernel compiled for one is not reused by another."""
    from importlib import metadata

    try:
        version = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source install
        import cutlass

        version = getattr(cutlass, "__version__", "unknown")
    arch = os.environ.get("CUTE_DSL_ARCH", "")
    if not arch:
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                arch = f"sm_{major}{minor}"
        except Exception:  # noqa: BLE001 - no GPU: the DSL's own default
            arch = ""
    return f"{version}/{arch or 'default'}"


def kernel_digest(kind: str, key: tuple) -> str:
    text = repr((kind, key, source_digest(), _toolchain()))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _loads_object_files() -> bool:
    """CuTe DSL 4.8 loads an exported object file directly; 4.3.5 loads shared libraries only."""
    try:
        import cutlass.base_dsl.export.external_binary_module  # noqa: F401
    except ImportError:
        return False
    return True


def _runtime_libraries() -> list[str]:
    import cutlass.cute as cute

    find = getattr(cute.runtime, "find_runtime_libraries", None)
    return [p for p in (find(enable_tvm_ffi=False) if find else []) if os.path.exists(p)]


def _load(path: Path, symbol: str) -> Any:
    import cutlass.cute as cute

    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, symbol)


def _store(compiled: Any, path: Path, symbol: str) -> None:
    """Export ``compiled`` to ``path`` (an object file, or a shared library linked from one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj = os.path.join(tmp, "kernel.o")
        compiled.export_to_c(obj, function_name=symbol)
        out = obj
        if path.suffix == ".so":
            out = os.path.join(tmp, "kernel.so")
            libs = _runtime_libraries()  # with their directories as rpath: found without cutlass
            rpaths = [f"-Wl,-rpath,{d}" for d in dict.fromkeys(os.path.dirname(p) for p in libs)]
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, "-shared", "-o", out, obj, *libs, *rpaths], check=True,
                           capture_output=True, timeout=120)
        os.replace(out, path)


def kernel_path(kind: str, key: tuple) -> Optional[Path]:
    """Where the kernel (kind, key) is kept, or None with the cache off."""
    directory = cache_dir()
    if directory is None:
        return None
    suffix = ".o" if _loads_object_files() else ".so"
    return directory / f"{kind}-{kernel_digest(kind, key)}{suffix}"


def compile_cached(kind: str, key: tuple, build: Callable[[], Any]) -> Any:
    """The kernel ``build()`` compiles, loaded from the cache when an earlier process stored it.

    kind, key: what the kernel's code depends on besides distnorm's sources and the toolchain (the
    compile-time arguments); their ``repr`` must be stable across processes.
    """
    path = kernel_path(kind, key)
    if path is None:
        return build()
    symbol = f"distnorm_{kernel_digest(kind, key)[:24]}"
    if path.exists():
        try:
            return _load(path, symbol)
        except Exception as e:  # noqa: BLE001 - a damaged file: compile again and replace it
            log.warning("kernel cache: could not load %s (%s); compiling it again", path, e)
    compiled = build()
    try:
        _store(compiled, path, symbol)
    except Exception as e:  # noqa: BLE001 - no cache is slower, not wrong
        log.warning("kernel cache: could not store %s (%s)", path, e)
    return compiled
