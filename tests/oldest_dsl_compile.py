"""Compile every kernel variant with the oldest CuTe DSL the project supports, without a GPU.

    CUTE_DSL_ARCH=sm_90a python tests/oldest_dsl_compile.py PACKAGES [K N]

PACKAGES: the `python_packages` folder of an nvidia-cutlass-dsl 4.3.5 install (the lower bound in
pyproject.toml), e.g. `pip install --no-deps --target DIR nvidia-cutlass-dsl==4.3.5` gives
DIR/nvidia_cutlass_dsl/python_packages; the rest of the environment (torch, the TVM-FFI package)
is the current one. 4.3.5 has no GPU-free mode of its own, but it compiles fake-tensor signatures
through PTX and cubin and needs the CUDA driver only to load the result (`Compiler.jit`); that
step is replaced here by an exception, so a variant passes when its compile got that far. This
catches what the newest DSL accepts and 4.3.5 refuses (its AST preprocessor, for one, types each
name across a function's run-time `if`s), which the CPU tests on the newest DSL cannot see.
K N: only every N-th variant from the K-th (to share the list over processes). Prints each
failing variant, then `compiled X of Y`; exits 1 if any failed.
"""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))


class _CompiledWithoutGPU(Exception):
    """Raised where 4.3.5 would load the compiled module onto a GPU."""


def _use_packages(packages: str) -> None:
    # no kernel cache: its key reads the DSL version from the installed distribution (the newest)
    os.environ["DISTNORM_KERNEL_CACHE"] = "0"
    # the newest DSL's .pth put its own `cutlass` first on sys.path: take it out
    sys.path[:] = [p for p in sys.path if not p.endswith("dsl_packages")]
    sys.path[:0] = [packages, os.path.dirname(_TESTS), _TESTS]
    from cutlass.base_dsl import compiler

    def refuse_to_load(self, module, *args, **kwargs):
        raise _CompiledWithoutGPU()

    compiler.Compiler.jit = refuse_to_load


def _reached_load(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _CompiledWithoutGPU):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def main(packages: str, first: int = 0, step: int = 1) -> int:
    _use_packages(packages)
    import cutlass
    from ptx_fingerprint import kernel_variants

    if not os.path.realpath(cutlass.__file__).startswith(os.path.realpath(packages)):
        print(f"cutlass imported from {cutlass.__file__}, not from {packages}")
        return 1
    variants = kernel_variants()[first::step]
    failed = 0
    for name, compile_variant in variants:
        try:
            compile_variant()
            ok = True  # a GPU after all: it compiled and loaded
        except Exception as e:  # noqa: BLE001 - the DSL wraps our exception in its own
            ok = _reached_load(e)
            if not ok:
                failed += 1
                print(f"FAILED {name}: {type(e).__name__}: {str(e).strip()[-800:]}", flush=True)
    print(f"compiled {len(variants) - failed} of {len(variants)}")
    return 1 if failed else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[0], *(int(a) for a in args[1:3])))
