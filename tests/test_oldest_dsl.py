"""Every kernel variant compiles with the oldest supported CuTe DSL (tests/oldest_dsl_compile.py).

Runs where DISTNORM_OLDEST_DSL names the `python_packages` folder of an nvidia-cutlass-dsl 4.3.5
install (.ci/run installs one); skipped otherwise. The variants are shared over two processes.
"""
import os
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = os.environ.get("DISTNORM_OLDEST_DSL", "")


@pytest.mark.skipif(not PACKAGES, reason="DISTNORM_OLDEST_DSL (a CuTe DSL 4.3.5 python_packages "
                    "folder) not set; .ci/run sets it")
def test_every_kernel_compiles_with_the_oldest_dsl():
    env = dict(os.environ, CUTE_DSL_ARCH=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    shards = 2
    procs = [subprocess.Popen([sys.executable, os.path.join(_HERE, "oldest_dsl_compile.py"),
                               PACKAGES, str(k), str(shards)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in range(shards)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    report = "\n".join(line for out in outputs for line in out.splitlines()
                       if line.startswith(("FAILED", "compiled", "cutlass imported")))
    assert all(p.returncode == 0 for p in procs), report or "\n".join(o[-3000:] for o in outputs)
    assert report.count("compiled ") == shards, report
