"""The on-disk kernel cache (distnorm/kernels/disk_cache.py): keys, and a second process loading
what the first compiled (CPU: CuTe DSL 4.8+ compiles without a GPU; on a GPU machine the GPU tests
run the loaded kernels)."""
from __future__ import annotations

import os

import pytest

from cute_compile import compile_in_subprocess


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    from distnorm.kernels import disk_cache

    monkeypatch.setenv(disk_cache.CACHE_ENV, "0")
    assert disk_cache.cache_dir() is None
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path
    monkeypatch.delenv(disk_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "distnorm" / "kernels"


def test_a_kernel_is_named_by_its_key_sources_and_toolchain(monkeypatch):
    pytest.importorskip("cutlass")
    from distnorm import formats
    from distnorm.kernels import disk_cache

    spec = formats.make_quant_spec("nvfp4")
    a = disk_cache.kernel_digest("K", ("bfloat16", 4096, spec, True))
    assert a == disk_cache.kernel_digest("K", ("bfloat16", 4096, formats.make_quant_spec("nvfp4"), True))
    assert a != disk_cache.kernel_digest("K", ("bfloat16", 4096, spec, False))
    assert a != disk_cache.kernel_digest("L", ("bfloat16", 4096, spec, True))
    monkeypatch.setattr(disk_cache, "source_digest", lambda: "edited")
    assert a != disk_cache.kernel_digest("K", ("bfloat16", 4096, spec, True))


def test_every_argument_of_a_kernel_builder_names_its_kernel(monkeypatch):
    """compat.compiled_kernel files a kernel under all of its builder's arguments, defaults
    included: a parameter added to a builder cannot be left out of the disk cache's name."""
    pytest.importorskip("cutlass")
    from distnorm.kernels import compat

    seen = []
    monkeypatch.setattr(compat, "compile_tvm_ffi", lambda kernel, *args, cache_key: seen.append(cache_key))

    @compat.compiled_kernel(object)
    def build(dtype: str, hidden: int, split: int = 1):
        return object(), ()

    build("bfloat16", 4096)
    build("bfloat16", 4096, split=4)
    build("bfloat16", 4096, 1)  # another call form of the first key: memoized apart, same name
    assert seen == [("bfloat16", 4096, 1), ("bfloat16", 4096, 4), ("bfloat16", 4096, 1)]
    assert build.cache_key("bfloat16", 4096) == ("bfloat16", 4096, 1)


def test_the_digest_covers_what_the_kernels_import():
    """The kernels take word offsets and tables from modules outside kernels/: an edit there must
    rename every kernel (a kernel with an old signal-pad layout would hang or corrupt)."""
    import ast
    from pathlib import Path

    from distnorm.kernels import disk_cache

    package = Path(disk_cache.__file__).resolve().parent.parent
    covered = {p.relative_to(package).as_posix() for p in disk_cache.source_files()}
    imported = set()
    for path in (package / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distnorm."):
                rel = node.module.split(".", 1)[1].replace(".", "/")
                imported.add(rel + ".py" if (package / (rel + ".py")).exists() else rel + "/__init__.py")
    assert {"collectives/layout.py", "collectives/plan.py", "collectives/signature.py"} <= imported
    assert imported <= covered, imported - covered


_COMPILE_TWO = """
import logging
from distnorm import formats
from distnorm.kernels.compile import compiled_fused_norm

class Count(logging.Handler):
    def emit(self, record):
        if hasattr(record, "compile_s"):  # one per kernel compiled (not the cache's warnings)
            done.append(record.getMessage())
log = logging.getLogger("distnorm.compile")
log.addHandler(Count())
log.setLevel(logging.DEBUG)
log.propagate = False
for quant in ("fp8_per_token", "nvfp4"):
    f = compiled_fused_norm("bfloat16", 4096, formats.make_quant_spec(quant), True, False, True)
    assert callable(f)
"""


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cache = str(tmp_path / "kernels")
    assert compile_in_subprocess(_COMPILE_TWO, kernel_cache=cache) == 2  # compiled and stored
    files = sorted(os.listdir(cache))
    assert len(files) == 2 and all(f.startswith("FusedAddRMSNormQuant-") for f in files)
    assert compile_in_subprocess(_COMPILE_TWO, kernel_cache=cache) == 0  # loaded, none compiled
    with open(os.path.join(cache, files[0]), "wb") as f:
        f.write(b"damaged")
    assert compile_in_subprocess(_COMPILE_TWO, kernel_cache=cache) == 1  # compiled again, replaced
    assert compile_in_subprocess(_COMPILE_TWO, kernel_cache=cache) == 0


_PRECOMPILE = """
import logging
import torch
from distnorm import formats
from distnorm.kernels.compile import compiled_fused_norm
from distnorm.kernels.precompile import precompile
from distnorm.ops import fused_kernel_key

class Count(logging.Handler):
    def emit(self, record):
        if hasattr(record, "compile_s"):
            done.append(record.getMessage())
log = logging.getLogger("distnorm.compile")
log.addHandler(Count())
log.setLevel(logging.DEBUG)
log.propagate = False
from distnorm.collectives.dispatch import allreduce_kernel_key
from distnorm.kernels.compile_allreduce import compiled_allreduce
keys = [("fused_norm", *fused_kernel_key(torch.bfloat16, 4096, formats.make_quant_spec(q), True,
                                         False, True, 1)) for q in ("fp8_per_token", "nvfp4")]
keys.append(("allreduce", *allreduce_kernel_key("oneshot", 2, torch.bfloat16, 4096,
                                                formats.make_quant_spec("fp8"), True, False,
                                                True, False)))
assert precompile(keys + keys, workers=2) == 3  # each key once, in the workers
assert precompile(keys) == 0  # all cached now
for key in keys[:2]:
    compiled_fused_norm(*key[1:])  # loaded: this process compiles nothing
compiled_allreduce(*keys[2][1:])
"""


def test_precompile_in_workers_then_load(tmp_path):
    assert compile_in_subprocess(_PRECOMPILE, kernel_cache=str(tmp_path / "k")) == 0
    assert len(os.listdir(tmp_path / "k")) == 3


def test_shared_library_path_of_older_dsls(tmp_path):
    """CuTe DSL 4.3.5 loads shared libraries only: the exported object is linked to one (with the
    DSL runtime's directory as rpath). Exercised here with the newer DSL's export."""
    body = "from distnorm.kernels import disk_cache\ndisk_cache._loads_object_files = lambda: False\n"
    cache = tmp_path / "k"
    assert compile_in_subprocess(body + _COMPILE_TWO, kernel_cache=str(cache)) == 2
    assert all(f.endswith(".so") for f in os.listdir(cache)) and len(os.listdir(cache)) == 2
    assert compile_in_subprocess(body + _COMPILE_TWO, kernel_cache=str(cache)) == 0


def test_the_suite_finds_per_process_and_multi_gpu_kernel_keys():
    from types import SimpleNamespace

    from precompile_keys import keys_of

    def kernel_keys(test, params):
        return [("k", test, params.get("H"))]

    module = SimpleNamespace(kernel_keys=kernel_keys)

    def item(name, multigpu, **params):
        return SimpleNamespace(module=module, originalname=name,
                               callspec=SimpleNamespace(params=params) if params else None,
                               get_closest_marker=lambda m: multigpu if m == "multigpu" else None)

    items = [item("a", False, H=1), item("b", True), item("c", True, H=2),
             SimpleNamespace(module=None, originalname="d")]
    assert keys_of(items) == ([("k", "a", 1)], [("k", "b", None), ("k", "c", 2)])


def test_a_key_its_builder_refuses_is_named_not_raised(monkeypatch, tmp_path):
    """A test's kernel list out of date with a builder's arguments (a key one field too long, as
    on 2026-12-04) is dropped from the precompile, on every rank alike, and named in the line;
    raised there it failed the collection of every rank (INTERNALERROR)."""
    from types import SimpleNamespace

    import precompile_keys
    from distnorm.kernels import disk_cache
    from distnorm.kernels import precompile as pc

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(pc, "precompile", lambda keys, workers=None: len(keys))
    monkeypatch.setattr(pc, "wait_for", lambda keys, timeout_s: True)
    good = ("fused_norm", "bfloat16", 4096)  # nameable below; compiling is faked above
    bad = ("fused_norm", "bfloat16", 4096, "one field too many")
    monkeypatch.setattr(pc, "cached_path",
                        lambda key: (_ for _ in ()).throw(TypeError("too many positional arguments"))
                        if key == bad else tmp_path / "k.so")
    module = SimpleNamespace(kernel_keys=lambda test, params: [good, bad])
    items = [SimpleNamespace(module=module, originalname=name, callspec=None,
                             get_closest_marker=lambda m, g=gpus: g if m == "multigpu" else None)
             for name, gpus in (("a", False), ("b", True))]
    for rank in (0, 1):
        env = SimpleNamespace(rank=rank, world_size=2, is_multiprocess=True)
        line = precompile_keys.precompile_for(items, env)
        assert "1 kernel keys refused" in line and "one field too many" in line, line
        assert f"compiled {2 - rank} kernels" in line, line  # good (a) and, on rank 0, good (b)


_PRECOMPILE_A_BAD_KEY = """
import torch
from distnorm import formats
from distnorm.kernels import precompile as pc
from distnorm.ops import fused_kernel_key

bad = ("fused_norm", *fused_kernel_key(torch.bfloat16, 4096, formats.make_quant_spec("fp8"), True,
                                       False, True, 1))
bad = bad[:2] + (4100,) + bad[3:]  # H = 4100: not a multiple of 8, does not compile
assert pc.precompile([bad], workers=1) == 0
assert pc.wait_for([bad], 5.0)  # settled: its failure marker is there
"""


def test_a_kernel_that_fails_to_compile_does_not_stall_the_others(tmp_path):
    assert compile_in_subprocess(_PRECOMPILE_A_BAD_KEY, kernel_cache=str(tmp_path / "k")) == 0
    assert [f for f in os.listdir(tmp_path / "k") if f.endswith(".failed")]


def test_multi_gpu_tests_list_the_kernels_they_launch(monkeypatch, tmp_path):
    """The multi-GPU files whose kernels compiled one at a time inside the tests (about 55 s of each
    rank's suite on 2 x H200) list them for tests/conftest.py's precompile: one key per kernel the
    test launches at world 2 (one per algorithm, format, H and dtype, and the plain allreduce of
    "none"), each one a key the kernel cache can name."""
    import importlib
    import sys

    pytest.importorskip("cutlass")
    from distnorm.kernels import disk_cache
    from distnorm.kernels.precompile import cached_path

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(importlib.import_module("distnorm.launch.spawn"), "launch_world_size",
                        lambda: 2)
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "multigpu"))
    shapes = importlib.import_module("test_allreduce_shapes_gpu")
    faults = importlib.import_module("test_faults_gpu")
    want = {(shapes, "test_fp16_activations"): 12, (shapes, "test_model_hidden_sizes"): 12,
            (shapes, "test_in_place_outputs"): 3,  # one kernel an algorithm, all three M
            # 10: lamport's NVFP4 call at 128 rows plans one-shot's kernel (listed already)
            (faults, "test_mismatched_calls_then_recovery"): 10,
            (faults, "test_rank_that_leaves"): 3, (faults, "test_something_else"): 0}
    for (module, test), n in want.items():
        keys = module.kernel_keys(test, {})
        assert len(keys) == len(set(keys)) == n, (test, keys)
        for key in keys:
            assert key[0] == "allreduce" and key[2] == 2, key
            assert cached_path(key).parent == tmp_path  # a key the cache can name
    fp16 = shapes.kernel_keys("test_fp16_activations", {})
    assert {k[3] for k in fp16} == {"float16"} and {k[4] for k in fp16} == {4096}
    assert {k[4] for k in shapes.kernel_keys("test_model_hidden_sizes", {})} <= {896, 2880, 5376}
    monkeypatch.setattr(importlib.import_module("distnorm.launch.spawn"), "launch_world_size",
                        lambda: 1)
    assert shapes.kernel_keys("test_fp16_activations", {}) == []
    sys.modules.pop("test_allreduce_shapes_gpu", None)
    sys.modules.pop("test_faults_gpu", None)


def test_multi_gpu_keys_follow_the_calls_sizes(monkeypatch):
    """At 4 ranks a two-shot call's kernel depends on its bytes (plan's NOTE [sized forms] and NOTE
    [sized rows per CTA]): the grid and batch-invariance tests list, for every M they call, the
    key that call plans (dispatch.planned_kernel_key), not the key of a 0-byte call."""
    import importlib
    import sys

    import torch

    from distnorm.collectives.dispatch import planned_kernel_key

    monkeypatch.setattr(importlib.import_module("distnorm.launch.spawn"), "launch_world_size",
                        lambda: 4)
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "multigpu"))
    grid = importlib.import_module("test_allreduce_gpu")
    cases = importlib.import_module("allreduce_cases")
    from invariance import BATCHES
    try:
        keys = set(grid.kernel_keys("test_allreduce_add_rmsnorm_grid", {"algo": "twoshot"}))
        H = grid.HIDDEN_OF["twoshot"][0]
        for qname in grid.QUANTS:
            spec = cases.quant_spec(qname)
            for M in [m for m in grid.TOKENS if m != "cap+1"]:
                want = planned_kernel_key("twoshot", 4, M, H, torch.bfloat16, cases.BUFFER_BYTES,
                                          spec, True, False, True, True, False)[2]
                assert ("allreduce", *want) in keys, (qname, M)
        keys = set(grid.kernel_keys("test_batch_invariance", {}))
        sized = {k for k in keys if k[0] == "allreduce" and k[1] == "twoshot"}
        assert len({k[-2:] for k in sized}) > 1, sized  # more than one (rows, form) by size
        for M, _ in BATCHES:
            want = planned_kernel_key("twoshot", 4, M, 16384, torch.bfloat16,
                                      cases.BUFFER_BYTES * 2, cases.quant_spec("fp8"), True,
                                      False, True, True, False)[2]
            assert ("allreduce", *want) in keys, M
    finally:
        for name in ("test_allreduce_gpu", "allreduce_cases"):
            sys.modules.pop(name, None)


_KEYS_AT_EVERY_WORLD = r"""
import importlib, sys
import pytest
sys.path[:0] = [{tests!r}]
from precompile_keys import keys_of
from distnorm.kernels.precompile import _builder

class KeysAtEveryWorld:
    def pytest_collection_finish(self, session):
        spawn = importlib.import_module("distnorm.launch.spawn")
        for world in (2, 4, 8):
            spawn.launch_world_size = lambda w=world: w
            for item in session.items:
                try:
                    keys = keys_of([item])[1]
                    n = len(keys)
                    for key in keys:  # arguments its builder takes (else precompile raises)
                        _builder(key[0]).cache_key(*key[1:])
                except Exception as e:  # a call that cannot be planned at this world size
                    print("FAILED", world, item.nodeid, repr(e)[:300])
                else:
                    print("KEYS", world, item.nodeid, n)

pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", {multigpu!r}],
            plugins=[KeysAtEveryWorld()])
"""


def test_multi_gpu_kernel_lists_plan_at_every_world_size():
    """Every multi-GPU test's kernel list (what tests/conftest.py compiles ahead) can be made at
    2, 4 and 8 ranks: its calls plan there (a workspace too small for a world size raises when
    planned: the fault tests' 16 MiB could not hold one-shot's NVFP4 chunk at 8 ranks) and each
    key is what its builder takes (a key of the wrong length made the collection of every
    multi-GPU run fail, 2026-12-04), so the suite's first 8-rank run does not fail at collection.
    Collected in a subprocess."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = _KEYS_AT_EVERY_WORLD.format(tests=tests, multigpu=os.path.join(tests, "multigpu"))
    env = {**os.environ, "DISTNORM_KERNEL_CACHE": "0"}  # collect only: no precompile on a GPU
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(tests), env=env).stdout
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    listed = [line for line in out.splitlines() if line.startswith("KEYS")]
    assert not failed, failed
    assert len(listed) >= 3 * 40, out[-2000:]  # every multi-GPU test at every world size
    assert any(line.startswith("KEYS 8 ") and not line.endswith(" 0") for line in listed)
